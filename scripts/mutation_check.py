"""Mutation check of the sampling proofs: break the rejection-sampling rule in three plausible
ways and show that the default suite's sampling tests fail each time.

Each mutation edits one line of `jaxspec/verify.py` in a copy of the repository, then runs the
acceptance rule's unit tests and the end-to-end chi-square tests there (default suite only) and
records which tests failed. The unmutated copy runs first and must pass. Prints a table and writes
docs/results/mutation_check.{json,md}.

    python scripts/mutation_check.py            # about 10 minutes on a 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from checkout import REPO, RESULTS

VERIFY = "jaxspec/verify.py"
TAKE_P = "p_at_bv = jnp.take_along_axis(p_bkv, accepted_b[:, None, None], axis=1)[:, 0]"
# (name, what it breaks, text in verify.py, its replacement)
MUTATIONS = [
    ("bonus-position", "after a full accept, the bonus token drawn from p at the last draft's position (k - 1) "
     "instead of the position after it (k)", TAKE_P,
     "p_at_bv = jnp.take_along_axis(p_bkv, jnp.where(accepted_b < num_drafts_b, accepted_b, "
     "jnp.maximum(accepted_b - 1, 0))[:, None, None], axis=1)[:, 0]"),
    ("accept-q-over-p", "a draft accepted with probability min(1, q/p) instead of min(1, p/q)",
     "accepted_prefix((u_bk * q_draft_bk < p_draft_bk) & usable_bk)",
     "accepted_prefix((u_bk * p_draft_bk < q_draft_bk) & usable_bk)"),
    ("residual-without-max", "after a rejection, the next token drawn from normalize(p - q) without max(0, .)",
     "jnp.maximum(p_at_bv - q_at_bv, 0.0)", "(p_at_bv - q_at_bv)"),
]
TESTS = {   # the default suite's tests of the rule: its unit tests, then end-to-end chi-squares
    "unit": ["tests/test_verify.py"],
    "end-to-end": ["tests/test_engine.py", "tests/test_batching.py", "-k", "sampling or distribution"],
}


def copy_repo(dest: Path, commit: str | None) -> None:
    """The library and its tests as in the working tree, or as committed at `commit`."""
    if commit is not None:
        archive = subprocess.run(["git", "archive", commit, "jaxspec", "tests", "pyproject.toml"], cwd=REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    for name in ("jaxspec", "tests"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")


def run_tests(copy: Path, args: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run([sys.executable, "-c", "import jaxspec; print(jaxspec.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(copy)):
        raise RuntimeError(f"the copy's jaxspec is not the one imported: {where}")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-m", "not slow", *args], cwd=copy, env=env, capture_output=True, text=True,
                         timeout=timeout)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", run.stdout, re.M)))
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    return dict(returncode=run.returncode, failed=failed, summary=summary,
                seconds=round(time.perf_counter() - start, 1))


def check(name: str, old: str | None, new: str | None, commit: str | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"jaxspec-mutant-{name}-") as tmp:
        copy = Path(tmp)
        copy_repo(copy, commit)
        if old is not None:
            text = (copy / VERIFY).read_text()
            if text.count(old) != 1:
                raise RuntimeError(f"{name}: the line to mutate is not in {VERIFY} exactly once: {old!r}")
            (copy / VERIFY).write_text(text.replace(old, new))
        return {part: run_tests(copy, args, timeout) for part, args in TESTS.items()}


def markdown(rows: list[dict]) -> str:
    lines = ["# Mutation check of the sampling proofs", "",
             "`python scripts/mutation_check.py`: each mutation edits one line of `jaxspec/verify.py` in a copy",
             "of the repository; the default suite's unit tests of the rule (`tests/test_verify.py`) and its",
             "end-to-end chi-square tests (`tests/test_engine.py`, `tests/test_batching.py`, `-k 'sampling or",
             "distribution'`) run there.", "",
             "| mutation | what it breaks | unit tests failed | end-to-end tests failed |", "|---|---|---|---|"]
    for row in rows:
        cells = []
        for part in TESTS:
            r = row[part]
            cases = Counter(f.split("::")[-1].split("[")[0] for f in r["failed"])
            names = ", ".join(f"{name} × {n}" if n > 1 else name for name, n in cases.items())
            summary = re.sub(r", \d+ deselected", "", r["summary"].split(" in ")[0])
            cells.append(f"{summary}: {names}" if r["failed"] else f"none ({summary})")
        lines.append(f"| {row['mutation']} | {row['what']} | {cells[0]} | {cells[1]} |")
    lines += ["", "End-to-end tests a mutation of `rejection_accept` cannot fail: the k = 0 plain step (no",
              "acceptance) and `test_scoring_the_drawn_token_would_bias_sampling` (it expects its own chi-square",
              "to fail). Passing (`ok` in the JSON) needs the unmutated copy to pass and every mutation to fail."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="mutation names to run (default: all)")
    parser.add_argument("--commit", default=None, help="check this commit (default: the working tree)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    parser.add_argument("--out", default=str(RESULTS / "mutation_check"))
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or m[0] in args.only]
    rows = []
    for name, what, old, new in [("none", "the code as it is (must pass)", None, None), *chosen]:
        result = check(name, old, new, args.commit, args.timeout)
        rows.append(dict(mutation=name, what=what, **result))
        print(name, {part: (len(r["failed"]), r["summary"]) for part, r in result.items()}, flush=True)
    baseline, mutants = rows[0], rows[1:]
    caught = {row["mutation"]: any(row[part]["failed"] or row[part]["returncode"] for part in TESTS)
              for row in mutants}
    ok = all(baseline[part]["returncode"] == 0 for part in TESTS) and all(caught.values())
    Path(args.out + ".json").write_text(json.dumps(dict(ok=ok, caught=caught, rows=rows), indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(rows))
    print(markdown(rows))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
