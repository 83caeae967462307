"""JSONL batch jobs: reading requests, and an output file that survives being killed.

Input: one JSON object per line, `{"id": ..., "prompt": ...}` with an optional per-request
`"max_new_tokens"`. The id is a string or an int; the prompt is a string (the model needs a
tokenizer) or a list of token ids. Blank lines are ignored.

Output: one JSON object per finished request, `{"id", "text", "tokens", "stats"}`, appended in one
`write` call, flushed and fsynced as soon as the request finishes. A run killed at any moment
therefore leaves whole lines, plus at most one torn line at the end, which `scan_output` finds
and `truncate` cuts away; a rerun skips the ids already written. Any other invalid line is an
error: this module never throws away a line it did not itself half-write.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


class JobFileError(ValueError):
    """A request or output file that cannot be used; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One request of a batch job.

    Attributes:
      id: the request's id (a str or an int), copied to its output line.
      prompt: a string, or a list of token ids.
      max_new_tokens: this request's budget; None: the job's default.
      line: its line number in the input file (1-based), for messages.
    """

    id: str | int
    prompt: str | list[int]
    max_new_tokens: int | None
    line: int


def id_key(request_id: Any) -> str:
    """The identity of a request id: its JSON text, so the id 1 and the id "1" stay distinct."""
    return json.dumps(request_id, sort_keys=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_job(text: str, where: str, line: int) -> Job:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise JobFileError(f"{where}:{line}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise JobFileError(f"{where}:{line}: expected a JSON object like {{\"id\": ..., \"prompt\": ...}}, "
                           f"got {type(record).__name__}")
    missing = [field for field in ("id", "prompt") if field not in record]
    if missing:
        raise JobFileError(f"{where}:{line}: missing field{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(repr(m) for m in missing)}")
    request_id, prompt = record["id"], record["prompt"]
    if not (isinstance(request_id, str) or _is_int(request_id)):
        raise JobFileError(f"{where}:{line}: \"id\" must be a string or an integer, got {json.dumps(request_id)}")
    if isinstance(prompt, str):
        if not prompt:
            raise JobFileError(f"{where}:{line}: \"prompt\" is empty")
    elif isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise JobFileError(f"{where}:{line}: \"prompt\" must be a string or a non-empty list of "
                               "integer token ids")
    else:
        raise JobFileError(f"{where}:{line}: \"prompt\" must be a string or a list of token ids, "
                           f"got {type(prompt).__name__}")
    max_new = record.get("max_new_tokens")
    if max_new is not None and (not _is_int(max_new) or max_new < 1):
        raise JobFileError(f"{where}:{line}: \"max_new_tokens\" must be an integer >= 1, got {json.dumps(max_new)}")
    return Job(id=request_id, prompt=prompt, max_new_tokens=max_new, line=line)


def read_jobs(path: str | os.PathLike, *, skip_bad_lines: bool = False,
              warn: Callable[[str], None] | None = None) -> list[Job]:
    """Reads and validates every request of a JSONL file (nothing is run or written).

    Args:
      path: the input file.
      skip_bad_lines: skip a line that is not valid JSON or lacks a valid id / prompt (each
        reported through `warn`) instead of failing. Duplicate ids are an error either way:
        which of the two requests was meant cannot be guessed.
      warn: called with a one-line message for each skipped line.

    Returns:
      The requests in file order.

    Raises:
      FileNotFoundError: no such file.
      JobFileError: a bad line (with its line number), a duplicate id, or no requests at all.
    """
    path = Path(path)
    where = str(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise JobFileError(f"{where} is a directory, not a JSONL file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise JobFileError(f"{where}:{line}: not valid UTF-8") from None
    jobs: list[Job] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            job = _parse_job(line, where, number)
        except JobFileError as err:
            if not skip_bad_lines:
                raise
            if warn is not None:
                warn(f"skipping {err}")
            continue
        key = id_key(job.id)
        if key in first_line:
            raise JobFileError(f"{where}:{number}: duplicate id {key} (first on line {first_line[key]})")
        first_line[key] = number
        jobs.append(job)
    if not jobs:
        raise JobFileError(f"{where} contains no requests (expected JSON lines like "
                           "{\"id\": \"a\", \"prompt\": \"...\"})")
    return jobs


@dataclasses.dataclass(frozen=True)
class OutputScan:
    """What an existing output file holds.

    Attributes:
      done: id keys (`id_key`) of the requests it already has.
      valid_bytes: length of its prefix of whole, valid lines.
      torn: the torn tail after that prefix (a line cut off by a kill), or "" if none.
      needs_newline: the last line is a whole record that only lacks its newline.
    """

    done: frozenset[str]
    valid_bytes: int
    torn: str = ""
    needs_newline: bool = False


def scan_output(path: str | os.PathLike) -> OutputScan:
    """Reads the ids already in an output file (an absent file holds none).

    The last line may be torn (not valid JSON, from a kill mid-write): it is reported in `torn`,
    not counted. An invalid line anywhere else means the file is not one of ours, or was edited:
    an error, because truncating there would throw finished work away.

    Raises:
      JobFileError: an invalid line before the last, or a record without an "id".
    """
    path = Path(path)
    if not path.exists():
        return OutputScan(done=frozenset(), valid_bytes=0)
    if path.is_dir():
        raise JobFileError(f"output {path} is a directory")
    raw = path.read_bytes()
    *whole, tail = raw.split(b"\n")   # `whole` lines had their newline; `tail` did not
    done: set[str] = set()
    offset = 0

    def parse(line: bytes, number: int) -> None:
        if not line.strip():
            return
        record = json.loads(line.decode("utf-8"))
        if not isinstance(record, dict) or "id" not in record:
            raise JobFileError(f"{path}:{number}: output line has no \"id\"; is {path} a jaxspec output file?")
        done.add(id_key(record["id"]))

    for number, line in enumerate(whole, start=1):
        try:
            parse(line, number)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if number == len(whole) and not tail:
                return OutputScan(done=frozenset(done), valid_bytes=offset, torn=line.decode("utf-8", "replace"))
            raise JobFileError(f"{path}:{number}: invalid line in the output file ({err}); it is not a torn last "
                               "line from an interrupted run, so it is left alone: fix or remove it, or use "
                               "another --output") from None
        offset += len(line) + 1
    if not tail:
        return OutputScan(done=frozenset(done), valid_bytes=offset)
    try:
        parse(tail, len(whole) + 1)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return OutputScan(done=frozenset(done), valid_bytes=offset, torn=tail.decode("utf-8", "replace"))
    # A whole record that only lacks its newline (an edited file): keep it, complete the line.
    return OutputScan(done=frozenset(done), valid_bytes=offset + len(tail), needs_newline=True)


def repair_output(path: str | os.PathLike, scan: OutputScan) -> None:
    """Cuts a torn last line away and completes a record missing its newline (see `scan_output`)."""
    if scan.torn:
        with open(path, "r+b") as f:
            f.truncate(scan.valid_bytes)
            f.flush()
            os.fsync(f.fileno())
    if scan.needs_newline:
        with open(path, "ab") as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())


class ResultWriter:
    """Appends one JSON line per finished request, durably (flush and fsync each line).

    Each line goes out in a single `write` of its bytes, so a kill leaves at most one torn line,
    at the end, which the next run's `scan_output` recognises.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        """Writes and syncs one record."""
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def request_stats(counters: dict[str, int]) -> dict[str, Any]:
    """The per-request statistics of an output line, from the engine's counters.

    new_tokens counts the first token (from the prefill); steps are the speculative steps the
    request was live in, so tokens_per_step is the mean tokens each of its steps emitted.
    """
    emitted, steps = counters["emitted"], counters["row_steps"]
    drafted, accepted = counters["drafted"], counters["accepted"]
    return {"new_tokens": emitted, "steps": steps, "drafted": drafted, "verified": counters["verified"],
            "accepted": accepted, "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_step": round((emitted - 1) / steps, 4) if steps else 0.0}


def pending(jobs: Iterable[Job], done: frozenset[str]) -> list[Job]:
    """The jobs whose ids are not in `done`, in order."""
    return [job for job in jobs if id_key(job.id) not in done]


def finished_tokens(paths: Iterable[str | os.PathLike]) -> dict[str, list[int]]:
    """{id_key: output tokens} of the complete lines in output files (a torn last line is skipped)."""
    out = {}
    for path in map(Path, paths):
        if path.is_file():
            for line in path.read_bytes().split(b"\n"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "id" in record:
                    out[id_key(record["id"])] = list(record.get("tokens") or [])
    return out
