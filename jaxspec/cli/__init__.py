"""The `jaxspec` command: `main.py` (entry point, `generate`, `merge`), `tools.py` (`profile`, `bench`,
`distill`, and the helpers the subcommands share), `eagle.py` (`train-eagle`), `jobs.py` (JSONL job
files), `multihost.py` (a job over several processes). `python -m jaxspec.cli` runs it too."""
