"""Batch jobs over several local processes (`jax.distributed` on CPU, gloo): the merged output of 2
and 3 processes equals one process's token for token; a process killed mid-run and a rerun with
another process count leave every request exactly once; a process started with other options is
refused before anything is written."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from test_cli import generate_args, killed_after, read_output, token_jobs, write_jobs

from jaxspec.cli import multihost

CLI = [sys.executable, "-m", "jaxspec.cli"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
OPTIONS = ("--draft", "ngram", "--k", "3", "--batch-size", "2", "--max-new-tokens", "12")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(n: int, base: list[str], per_process=lambda i: (), command=lambda i: CLI) -> list[subprocess.Popen]:
    """`jaxspec` (or `command(i)`) with `base` arguments, once per process of an n-process job."""
    port = free_port()
    return [subprocess.Popen(command(i) + base + ["--coordinator", f"localhost:{port}", "--num-processes", str(n),
                                           "--process-id", str(i), *per_process(i)],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(n)]


def finish(procs, timeout=240) -> list[str]:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-2000:] for o in outs)
    return outs


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_path):
    """A job of 14 requests and its single-process output."""
    folder = tmp_path_factory.mktemp("job")
    prompts = write_jobs(folder / "in.jsonl", token_jobs(14, seed=3))
    single = folder / "single.jsonl"
    proc = subprocess.run(CLI + generate_args(tiny_path, prompts, single, *OPTIONS), env=ENV, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return prompts, {i: r["tokens"] for i, r in read_output(single).items()}


@pytest.mark.slow   # 30 s: three process launches
def test_two_processes_merge_into_the_single_process_output(job, tiny_path, tmp_path):
    prompts, want = job
    out = tmp_path / "out.jsonl"
    outs = finish(launch(2, generate_args(tiny_path, prompts, out, *OPTIONS)))
    assert "| 0       |" in outs[0] and "| 1       |" in outs[0]   # process 0 prints every process's counts
    assert "setup_s" in outs[0] and "latency_p95_s" in outs[0]   # coordination time: only with several processes
    parts = [read_output(p) for p in multihost.parts(out)]
    assert len(parts) == 2 and all(len(p) == 7 for p in parts)   # round-robin shares
    subprocess.run(CLI + ["merge", str(out)], env=ENV, check=True, capture_output=True, timeout=60)
    merged = [json.loads(line) for line in open(out)]
    assert [r["id"] for r in merged] == [f"r{i}" for i in range(14)]   # input order, once each
    assert {r["id"]: r["tokens"] for r in merged} == want
    assert not multihost.parts(out)


@pytest.mark.slow   # about a minute: three process launches
def test_a_killed_process_and_a_rerun_with_three_leave_every_request_once(tiny_path, tmp_path):
    prompts = write_jobs(tmp_path / "in.jsonl", token_jobs(40, seed=4))
    single, out = tmp_path / "single.jsonl", tmp_path / "out.jsonl"
    subprocess.run(CLI + generate_args(tiny_path, prompts, single, *OPTIONS), env=ENV, check=True, capture_output=True,
                   timeout=240)
    want = {i: r["tokens"] for i, r in read_output(single).items()}
    base = generate_args(tiny_path, prompts, out, *OPTIONS)
    # Process 1 dies after its second line, mid-run: it has 18 more requests to go.
    procs = launch(2, base, lambda i: ("--batch-size", "1") if i == 1 else (),
                   command=lambda i: killed_after(2) if i == 1 else CLI)
    procs[1].wait(timeout=240)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:   # its peer is gone; it would wait for it at the end
            p.kill()
            p.wait()
    assert procs[1].returncode == -signal.SIGKILL and len(read_output(multihost.part_path(out, 1))) == 2
    finish(launch(3, base))
    written = [line for p in multihost.parts(out) for line in read_output(p)]
    assert sorted(written) == sorted(want)   # across all parts, each request once
    subprocess.run(CLI + ["merge", str(out)], env=ENV, check=True, capture_output=True, timeout=60)
    assert {i: r["tokens"] for i, r in read_output(out).items()} == want


def test_a_process_with_other_options_is_refused_before_anything_is_written(tiny_path, tmp_path):
    prompts, out = write_jobs(tmp_path / "in.jsonl", token_jobs(4)), tmp_path / "out.jsonl"
    procs = launch(2, generate_args(tiny_path, prompts, out, *OPTIONS), lambda i: ("--k", "2") if i else ())
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert all("process 1 was started with another k than process 0 (2 against 3)" in o for o in outs), outs
    assert not out.exists() and not multihost.parts(out)


def test_placement_flags_are_checked():
    assert multihost.placement(None, None, None) is None or "JAX_COORDINATOR_ADDRESS" in os.environ
    assert multihost.placement("h:1", 3, 2) == ("h:1", 3, 2)
    with pytest.raises(ValueError, match="go together"):
        multihost.placement("h:1", 2, None)
    with pytest.raises(ValueError, match=r"--process-id must be in 0..1 and --num-processes >= 1, got id 2 of 2"):
        multihost.placement("h:1", 2, 2)
