"""Batch jobs over several processes (hosts): `jaxspec generate` under `jax.distributed`.

The same command is started once per process with `--coordinator HOST:PORT --num-processes N
--process-id I` (or JAX's variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
Each process runs its own replica of the models on its own devices and its own share of the
requests:

- **Agreement.** Every process sends its job description (the input file's digest, the models,
  the decoding options) to all; where one differs from process 0's, every process stops, naming
  the process and the option, before anything is written.
- **Ownership.** Every process reads the output and every part file `OUT.part-J` (one per process
  of any earlier run), then waits for all the others (a barrier), so all see the same finished
  set. The requests not in it, in input order, are dealt round-robin: the j-th belongs to process
  j mod N. So each request has exactly one owner, and a rerun with any number of processes redoes
  only what no file holds.
- **Writing.** Process I appends to `OUT.part-I`, each line synced as it finishes (`jobs`).
  A request samples from the stream of its input position, so its tokens do not depend on which
  process ran it.
- **Merging.** `merge` writes OUT with every request once, in input order (the input file is
  named in the manifest `OUT.job.json` the job writes), and removes the parts, once their
  settings records (`OUT.part-I.settings.json`, see `settings`) agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxspec.cli import jobs as jobs_lib
from jaxspec.cli import settings as settings_lib

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def placement(coordinator: str | None, num_processes: int | None, process_id: int | None):
    """(coordinator, processes, id) from the flags, else from JAX's environment variables; None
    for a single-process job. Checked: all three or none, 0 <= id < processes."""
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        env = [os.environ.get(name) for name in ENV]
        if all(v is None for v in env):
            return None
        if any(v is None for v in env):
            raise ValueError(f"set all of {', '.join(ENV)} or none, got {dict(zip(ENV, env))}")
        try:
            given = (env[0], int(env[1]), int(env[2]))
        except ValueError:
            raise ValueError(f"{ENV[1]} and {ENV[2]} must be ints, got {env[1]!r} and {env[2]!r}") from None
    if any(v is None for v in given):
        raise ValueError("--coordinator, --num-processes and --process-id go together, got "
                         f"{coordinator!r}, {num_processes!r}, {process_id!r}")
    coordinator, n, i = given
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--process-id must be in 0..{n - 1} and --num-processes >= 1, got id {i} of {n}")
    return coordinator, n, i


def start(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the job (`jax.distributed`); every process of it must call this."""
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective: all processes must call it)."""
    data = np.frombuffer(text.encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.int32(len(data)))))
    padded = np.zeros(longest, np.uint8)
    padded[:len(data)] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(row).rstrip(b"\0").decode() for row in gathered]


def agree(description: dict) -> None:
    """Raises ValueError on every process unless all processes have the same description."""
    everyone = [json.loads(text) for text in _allgather_text(json.dumps(description, sort_keys=True))]
    for i, other in enumerate(everyone[1:], start=1):
        for key in sorted(set(everyone[0]) | set(other)):
            if other.get(key) != everyone[0].get(key):
                raise ValueError(f"process {i} was started with another {key} than process 0 ({other.get(key)!r} "
                                 f"against {everyone[0].get(key)!r}); every process of a job needs the same command "
                                 f"(this is process {jax.process_index()})")


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier of this name."""
    multihost_utils.sync_global_devices(name)


def gather(record: dict) -> list[dict]:
    """Every process's `record` (JSON), in process order."""
    return [json.loads(text) for text in _allgather_text(json.dumps(record))]


def digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def part_path(output, process_id: int) -> Path:
    return Path(f"{output}.part-{process_id}")


def parts(output) -> list[Path]:
    """The part files of `output` that exist, by process id."""
    found = [(int(p.name.rsplit("-", 1)[1]), p) for p in Path(output).parent.glob(Path(output).name + ".part-*")
             if p.name.rsplit("-", 1)[1].isdigit()]
    return [p for _, p in sorted(found)]


def finished(output) -> frozenset[str]:
    """Ids (`jobs.id_key`) of the requests the output or any part file holds."""
    done = set()
    for path in [Path(output), *parts(output)]:
        done |= jobs_lib.scan_output(path).done
    return frozenset(done)


def write_manifest(output, prompts) -> None:
    Path(f"{output}.job.json").write_text(json.dumps({"prompts": str(Path(prompts).resolve())}) + "\n")


class PeerProgress:
    """New lines (finished requests) and their tokens in the other processes' part files (read
    incrementally; a torn last line waits for its end)."""

    def __init__(self, output, own: int, num_processes: int, every: float = 1.0):
        self.paths = [part_path(output, i) for i in range(num_processes) if i != own]
        self.offsets = {p: p.stat().st_size if p.exists() else 0 for p in self.paths}
        self.every, self.last = every, 0.0

    def poll(self) -> tuple[int, int]:
        """(requests, tokens) finished since the last poll; reads the files at most every `every` s."""
        if time.monotonic() - self.last < self.every:
            return 0, 0
        self.last = time.monotonic()
        requests = tokens = 0
        for path in self.paths:
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[path])
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            self.offsets[path] += len(whole)
            for line in whole.splitlines():
                requests += 1
                tokens += len(json.loads(line).get("tokens", []))
        return requests, tokens


def merge(output, prompts=None, record: dict | None = None) -> dict:
    """Writes `output` with every request of the job once, in input order, from the output and its
    part files, then removes the parts. `prompts`: the input file (default: from the manifest);
    `record`: the merged settings record (`settings.merged`), written with it (the parts' go).
    Raises ValueError naming what is missing if the job has not finished."""
    manifest = Path(f"{output}.job.json")
    if prompts is None:
        if not manifest.exists():
            raise FileNotFoundError(f"{manifest} not found: pass --prompts IN.jsonl (the job's input file)")
        prompts = json.loads(manifest.read_text())["prompts"]
    order = [jobs_lib.id_key(job.id) for job in jobs_lib.read_jobs(prompts)]
    sources = [p for p in [Path(output), *parts(output)] if p.exists()]
    lines = {}
    for path in sources:
        for raw in path.read_bytes().splitlines():
            if raw.strip():
                try:
                    lines.setdefault(jobs_lib.id_key(json.loads(raw)["id"]), raw)
                except (json.JSONDecodeError, KeyError):   # a torn last line: its request runs again
                    continue
    missing = [key for key in order if key not in lines]
    if missing:
        raise ValueError(f"{len(missing)} of {len(order)} requests of {prompts} are in no output yet (first: id "
                         f"{missing[0]}); rerun the job to finish them, then merge")
    merged = Path(f"{output}.merging")
    with open(merged, "wb") as f:
        f.write(b"".join(lines[key] + b"\n" for key in order))
        f.flush()
        os.fsync(f.fileno())
    settings_lib.write_merged(output, record)
    os.replace(merged, output)
    for path in parts(output):
        settings_lib.sidecar(path).unlink(missing_ok=True)
        path.unlink()
    return {"requests": len(order), "parts": len(sources) - (Path(output) in sources), "output": str(output)}
