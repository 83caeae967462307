#!/usr/bin/env bash
# The prepared GPU measurement (scripts/device_check.py): first the segment engine (plain,
# speculative and EAGLE-head decoding) under each candidate XLA flag set, one process per set, in
# under 4 minutes; then step anatomy and bandwidth fraction in bfloat16 and int8, the attention
# paths at short and long live lengths, the EAGLE-3 head's step cost, TETRIS selection and packed
# verification, plain against speculative decoding; at the qwen2.5-1.5b shape, finishing well
# inside 8 minutes on an H100 / H200 (a deadline per section and a hard timeout), results in
# docs/results/gpu/ named after the device. `--cpu-smoke` runs every section at a tiny shape (the
# default test suite does).
#
#     scripts/device_check.sh [--cpu-smoke] [--out DIR] [--deadline SECONDS]
#
# From a session with a device lent: make device-wheels, then run `scripts/device_check.sh` with
# carry [".whl"] and a timeout of about 540 s; commit docs/results/gpu/ from the returned files.
set -u -o pipefail
limit=480
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && limit=420; done
if [ "$limit" = 480 ]; then
    . scripts/gpu_env.sh
else
    py=${PYTHON:-python3}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
timeout --signal=INT "$limit" "$py" scripts/device_check.py "$@" 2>&1 | grep -v "^WARNING: All log messages"
