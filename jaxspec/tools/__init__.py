"""Measurement tooling for `scripts/` and the command line, never imported by `import jaxspec`:
benchmark helpers (`benchmarking.py`), step anatomy (`profiling.py`), the policy simulator
(`policy_sim.py`), analytic models of chains (`multilevel.py`), the two-slice simulator
(`mesh_sim.py`)."""
