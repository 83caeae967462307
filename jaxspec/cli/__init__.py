"""The `jaxspec` command: `main.py` (entry point, `generate`), `tools.py` (`profile`, `bench`,
`distill`), `eagle.py` (`train-eagle`), `jobs.py` (JSONL job files), `multihost.py` (a job over
several processes, `merge`)."""

from jaxspec.cli.main import main

__all__ = ["main"]
