#!/usr/bin/env bash
# The goodput benchmark on a GPU at the qwen2.5-1.5b / qwen2.5-0.5b shapes (bfloat16), sized for
# a short lease: each program of the 28- and 24-layer models compiles in about 18 s on an H200, so
# the run profiles each batch's own shapes just before benchmarking it, leaves TETRIS out, times
# fixed k = 1, 2, 4 against the goodput policy (k <= 4), each round on its own prompt set (same
# shapes, no extra compiling), and starts a batch only if it should end
# by --deadline seconds; results are written after every batch. Extra arguments go to
# scripts/bench_goodput.py (later ones win). Runs with the machine's own python3 (PYTHON=...); if
# jaxspec does not import there, wheels in .whl/ (e.g. flax at this repo's version) are installed
# to /tmp/site and it retries.
#
#     scripts/bench_goodput_gpu.sh OUTDIR [--batches 1 64 16 4] [--deadline 540] ...
set -u -o pipefail
out=${1:?usage: $0 OUTDIR [bench_goodput.py arguments]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# A rerun on the same machine reuses what the first run compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
smoke='import jax, flax, jaxspec
m = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"))
print("jax", jax.__version__, "flax", flax.__version__, jax.devices(), jaxspec.generate(m, [[1, 2, 3]], max_new_tokens=4).tokens)'
if ! "$py" -c "$smoke"; then
    ls .whl/*.whl >/dev/null 2>&1 || exit 1
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    "$py" -c "$smoke" || exit 1
fi
"$py" scripts/bench_goodput.py --pair qwen2.5-shape --dtype bfloat16 --no-tetris --ks 1 2 4 --profile-per-batch \
    --profile-ks 0 1 2 4 --batches 1 64 16 4 --rounds 8 --prompt-sets 8 --deadline 540 --name "$(realpath "$out")/bench_goodput_qwen" \
    "$@" 2>&1 | grep -v "^WARNING: All log messages" | tee "$out/bench_goodput_qwen.log"
