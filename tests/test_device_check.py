"""scripts/device_check.sh --cpu-smoke: every section of the GPU check runs at a tiny shape, and
what it reports holds together (the check must work the first time a GPU is lent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow   # 120-150 s (suite time); run it before every GPU lease
def test_device_check_cpu_smoke(tmp_path):
    # The persistent compilation cache lets the step profile's second compile of a program (for
    # its text) load the first one's result.
    env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": "", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jit"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    # No section deadline: on a loaded machine sections would be skipped; the timeouts bound the run.
    proc = subprocess.run(["scripts/device_check.sh", "--cpu-smoke", "--out", str(tmp_path), "--deadline", "1e9"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_check_cpu.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"engine", "step_profile", "attention", "speculative", "trees", "xla_options", "eagle_head",
                             "tetris"}
    assert (tmp_path / "device_check_cpu.md").read_text().startswith("Device check on cpu")

    engine = sections["engine"]["rows"]   # one worker process per flag set; the first one runs every mode
    assert {(r["flags"], r["method"], r["S"]) for r in engine} == {
        ("default", "autoregressive", 1), ("default", "k=2", 2), ("default", "k=2", 1), ("default", "k=2", 4),
        ("default", "eagle k=2", 2), ("graphs", "autoregressive", 1), ("graphs", "k=2", 2),
        ("graphs_unrolled", "autoregressive", 1), ("graphs_unrolled", "k=2", 2)}
    assert all(r["same_output"] and r["batch"] == 2 for r in engine) and not sections["engine"]["skipped"]
    assert all(0 <= r["masked"] < 1 for r in engine if r["S"] > 1) and engine[1]["tokens_per_pass"] > 1

    rows = sections["step_profile"]["rows"]
    assert {(r["quantization"], r["batch"], r["k"]) for r in rows} == {
        (None, 2, 0), (None, 1, 3), ("int8", 2, 0)}
    for r in rows:
        assert r["kernels_per_step"] > 10
        assert abs(r["bandwidth_fraction"] - r["floor_ms"] / r["step_ms"]) < 1e-9
        assert abs(sum(c["ms"] for c in r["by_category"].values()) - r["kernel_ms"]) < 1e-6
        # rows * context * (keys, values) * layers * kv heads * head dim * 2 bytes (bfloat16)
        assert r["bytes"]["kv_cache"] == r["batch"] * 32 * 2 * 2 * 2 * 16 * 2
    bf16, int8 = ({r["batch"]: r["bytes"]["weights"] for r in rows if r["quantization"] == q} for q in (None, "int8"))
    assert 0.45 < int8[2] / bf16[2] < 0.6   # int8 matrices: half of bfloat16's bytes, plus scales and norms

    attention = {(r["attention"], r["live_slots"]): r["step_ms"] for r in sections["attention"]["rows"]}
    assert set(attention) == {(impl, live) for impl in ("plain", "blocked", "xla") for live in (16, 96)}
    xla = sections["xla_options"]
    assert [r["options"] for r in xla["rows"]] == ["default", "opt_level_1"] and "error" not in xla["rows"][1]
    assert set(xla["compile_s_by_layers"]) == {"2", "1"}
    assert 0 < sections["eagle_head"]["head_step_over_target_step"]
    assert all(r["packed_tokens"] == r["batch"] + r["capacity"] for r in sections["tetris"]["packed"])
    spec = sections["speculative"]["rows"]
    assert [r["method"] for r in spec] == ["autoregressive", "k=2"]
    assert all(r["same_output"] for r in spec)
    assert 0 < spec[1]["acceptance"] <= 1
    trees = sections["trees"]["rows"]
    assert [r["method"] for r in trees] == ["autoregressive", "tree 2x2 k=2", "tree 2x2 k=2 TETRIS"]
    assert all(r["same_output"] for r in trees) and all(r["tokens_per_pass"] > 1 for r in trees[1:])
