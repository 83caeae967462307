# Sourced by the GPU scripts: the machine's own python (PYTHON=...), a persistent compilation
# cache (a rerun on the same machine reuses what the first run compiled), and, if jaxspec does not
# import there, the wheels in .whl/ (e.g. flax at this repo's version) installed to /tmp/site.
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
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
