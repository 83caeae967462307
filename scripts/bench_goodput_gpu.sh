#!/usr/bin/env bash
# The goodput benchmark on a GPU at the qwen2.5-1.5b / qwen2.5-0.5b shapes (bfloat16), sized for
# a short lease: each program of the 28- and 24-layer models compiles in about 18 s on an H200, so
# the run profiles each batch's own shapes just before benchmarking it, leaves TETRIS out, times
# fixed k = 1, 2, 4 against the goodput policy (k <= 4), each round on its own prompt set (same
# shapes, no extra compiling), and starts a batch only if it should end
# by --deadline seconds; results are written after every batch. Extra arguments go to
# scripts/bench_goodput.py (later ones win). The environment: scripts/gpu_env.sh.
#
#     scripts/bench_goodput_gpu.sh OUTDIR [--batches 1 64 16 4] [--deadline 540] ...
set -u -o pipefail
out=${1:?usage: $0 OUTDIR [bench_goodput.py arguments]}
shift
mkdir -p "$out"
. scripts/gpu_env.sh
"$py" scripts/bench_goodput.py --pair qwen2.5-shape --dtype bfloat16 --no-tetris --ks 1 2 4 --profile-per-batch \
    --profile-ks 0 1 2 4 --batches 1 64 16 4 --rounds 8 --prompt-sets 8 --deadline 540 --name "$(realpath "$out")/bench_goodput_qwen" \
    "$@" 2>&1 | grep -v "^WARNING: All log messages" | tee "$out/bench_goodput_qwen.log"
