"""A batch job's settings, recorded next to its output so a rerun cannot silently mix them.

Each file that holds result lines (`OUT.jsonl`, or `OUT.jsonl.part-I` in a multi-process job) gets
a sidecar `<file>.settings.json`, written before its first line: the settings that change a
request's tokens (`job_settings`), the input file, and the line they apply from. A
sidecar rather than a header line keeps every line of the output a result (`{"id", ...}`), so
readers of the output, the resume scan and `jaxspec merge` read the files as before, and a part
file carries the settings of the process that wrote it, which `merge` compares.

A rerun compares its settings with every sidecar of the job (`check`) before anything is loaded
or written: a difference is an error naming each setting, unless the run allows mixed settings;
then it appends, and the sidecar lists the later settings under "mixed", each with the line it
starts at. A sidecar whose file holds no lines yet is stale (a run that stopped before writing)
and is ignored.

Models are identified by content, not by name or date: the SHA-256 of the first and last MiB of
each file and the byte count. That is cheap on a multi-GB file, stays the same when a model is
copied or moved (hosts of a multi-process job each read their own copy; a modification time
would differ), and changes with the header (architecture, quantization) or the last tensors
(two fine-tunes of one base share the header, often a whole tokenizer's worth of it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT = "jaxspec-settings/1"
MIB = 1 << 20


def sidecar(path) -> Path:
    """The settings file of an output (or part) file."""
    return Path(f"{path}.settings.json")


def _hidden(path: Path, root: Path) -> bool:
    """A file under a dot-folder or dot-named (a download tool's cache), which is not the model."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def fingerprint(spec: str | None) -> dict[str, str] | str | None:
    """A model (or cost model) argument's identity: `preset:NAME` and keywords as they are, a file or
    folder as {"path", "content"}, "content" being what `check` compares (see the module doc)."""
    if spec is None or not Path(spec).exists():
        return spec
    root = Path(spec)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))
    digest, total = hashlib.sha256(), 0
    for file in files:
        size = file.stat().st_size
        total += size
        digest.update(f"{file.relative_to(root) if file != root else ''}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(MIB))
            if size > MIB:
                f.seek(max(MIB, size - MIB))
                digest.update(f.read(MIB))
    return {"path": str(root.resolve()), "content": f"sha256:{digest.hexdigest()[:16]}, {total} bytes"}


def job_settings(args, spec, form) -> dict[str, Any]:
    """The settings of a `jaxspec generate` run that change a request's tokens: the models (by
    content), the speculative configuration in effect (`spec`: the run's SpecConfig; --k and co.
    do not count with --draft none), sampling, seed, budget, weight types, chat template and eos.
    `form`: the run's `checks.DraftForm`."""
    draft = form.text if form.model is None else fingerprint(form.model)
    if form.model is not None and form.lookup is not None:
        content = draft["content"] if isinstance(draft, dict) else draft
        draft = {"path": form.text, "content": f"{form.lookup}+{content}"}
    return {"target": fingerprint(args.target), "draft": draft, "k": spec.k, "tree": spec.tree,
            "selection": spec.selection, "extra": spec.extra, "capacity": spec.capacity, "policy": spec.policy,
            "cost_model": fingerprint(args.cost_model), "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "seed": args.seed, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
            "quantize": args.quantize, "chat": args.chat, "eos": args.eos}


def _compared(value):
    value = list(value) if isinstance(value, tuple) else value
    return value["content"] if isinstance(value, dict) else value


def _shown(value) -> str:
    if isinstance(value, dict):
        return f"{value['path']} ({value['content']})"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def differences(before: dict, now: dict, then: str = "in the job", later: str = "now") -> list[str]:
    """`name: OLD in the job, NEW now` for each setting that differs (content, not paths, for models)."""
    return [f"{key}: {_shown(before.get(key))} {then}, {_shown(now.get(key))} {later}"
            for key in sorted(set(before) | set(now)) if _compared(before.get(key)) != _compared(now.get(key))]


def _lines(path) -> int:
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(MIB), b""))


def read(path) -> dict | None:
    """The settings record of an output (or part) file that holds lines; None if it holds none (a
    record there is stale) or has no record (written by a jaxspec before records)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0 or not sidecar(path).exists():
        return None
    try:
        record = json.loads(sidecar(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{sidecar(path)}: not a settings record ({err.msg}); fix or remove it") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{sidecar(path)}: not a {FORMAT} settings record; fix or remove it")
    return record


def check(paths, now: dict, allow_mixed: bool, warn: Callable[[str], None]) -> None:
    """Raises ValueError (one line, each difference named) unless every file of the job that holds
    lines was written with the settings `now`; with `allow_mixed`, warns instead."""
    for path in paths:
        record = read(path)
        if record is None:
            if Path(path).is_file() and Path(path).stat().st_size:
                warn(f"{path} has no settings record (written by an older jaxspec): its settings are not checked")
            continue
        found = differences(record["settings"], now)
        if found and not allow_mixed:
            raise ValueError(f"{path} was written with other settings: {'; '.join(found)}. Rerun with the job's "
                             "settings or another --output, or pass --allow-mixed-settings to append anyway")
        if found:
            warn(f"appending to {path} with other settings ({'; '.join(found)}): --allow-mixed-settings")


def _write(path, record: dict) -> None:
    """Writes a sidecar whole or not at all (a temporary file, synced, renamed over it)."""
    target = sidecar(path)
    temporary = Path(f"{target}.tmp")
    with open(temporary, "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, target)


def record(path, now: dict, prompts: str) -> None:
    """Records the settings of the lines about to be appended to `path` (call before the first is
    written): a new record for a file without lines, a "mixed" entry for other settings (allowed
    by `check`) than the record's, nothing when they are the record's or the last entry's."""
    lines = _lines(path)
    entry = {"settings": now, "prompts": str(Path(prompts).resolve()), "from_line": lines + 1}
    existing = read(path)
    if existing is None:
        _write(path, {"format": FORMAT, **entry, "mixed": []})
        return
    latest = (existing["mixed"] or [existing])[-1]["settings"]
    if differences(existing["settings"], now) and differences(latest, now):
        _write(path, {**existing, "mixed": [*existing["mixed"], entry]})


def merged(paths, allow_mixed: bool, warn: Callable[[str], None]) -> dict | None:
    """The record of a job merged from `paths` (the output and its parts), once their records agree.

    Raises:
      ValueError: two files were written with other settings (each difference named), unless
        `allow_mixed`; the merged record then lists the others under "mixed".
    """
    records = [(Path(p), read(p)) for p in paths]
    unrecorded = [str(p) for p, r in records if r is None and p.is_file() and p.stat().st_size]
    if unrecorded:
        warn(f"no settings record for {', '.join(unrecorded)} (an older jaxspec): not checked")
    records = [(p, r) for p, r in records if r is not None]
    if not records:
        return None
    (first, base), mixed = records[0], []
    for path, other in records[1:]:
        found = differences(base["settings"], other["settings"], f"in {first.name}", f"in {path.name}")
        if found and not allow_mixed:
            raise ValueError(f"the parts were written with other settings: {'; '.join(found)}; rerun the odd "
                             "part's requests, or pass --allow-mixed-settings to merge anyway")
        mixed += [{**other, "from_line": None}] if found else []
    mixed += [{**entry, "from_line": None} for _, r in records for entry in r["mixed"]]
    whole = not unrecorded and all(r["from_line"] == 1 for _, r in records)
    return {"format": FORMAT, "settings": base["settings"], "prompts": base["prompts"],
            "from_line": 1 if whole else None,
            "mixed": [{k: v for k, v in m.items() if k not in ("format", "mixed")} for m in mixed]}


def write_merged(path, merged_record: dict | None) -> None:
    """Writes the merged output's record (None: leaves none)."""
    if merged_record is not None:
        _write(path, merged_record)
