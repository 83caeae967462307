"""Shared fixtures. Eight virtual CPU devices are requested before JAX starts its backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# Kernel probing (`jaxspec.engine.kernels`) is tested in test_kernels; elsewhere programs compile
# with XLA's defaults, so the suite's hundreds of tiny shapes are not each timed.
os.environ.setdefault("JAXSPEC_KERNELS", "xla")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxspec  # noqa: E402

# A persistent compilation cache, new and empty for each test session. Tests build many decoders
# whose programs lower to the same HLO (same model shapes, same buckets); each decoder owns its jit
# wrappers, so without this every one of them compiled again. A cache hit loads the executable
# instead (on this 2-core VM a tiny decoder's first call drops from 6 s to 1.5 s). Starting empty
# keeps a session's results independent of earlier runs. The process that creates it (pytest's
# main process) names it in the environment, so the xdist workers it starts share it: a program
# one worker compiled, the other loads; it is removed when the main process exits.
_XLA_CACHE = os.environ.get("JAXSPEC_TEST_XLA_CACHE")
if _XLA_CACHE is None or not os.path.isdir(_XLA_CACHE):
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxspec-test-xla-cache-")
    os.environ["JAXSPEC_TEST_XLA_CACHE"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _memory_map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


# XLA's CPU backend maps memory regions for the code of every compiled program (6 for a trivial
# one, about 120 for a decode program); Linux caps a process at vm.max_map_count (65530 by
# default) regions, and past it mmap fails and compilation segfaults. Freed only per module, the
# heaviest modules peaked (run alone, one process) at 19,500 maps in the default suite
# (test_engine; test_trees 14,100, test_eagle 10,000) but 39,400 in the slow step (test_engine;
# test_eagle 14,400, test_trees 13,400): too near the cap to drop the mid-module trigger.
_MAP_LIMIT = 20000


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each module's compiled programs when it ends (`jaxspec.clear_caches`)."""
    yield
    jaxspec.clear_caches()


@pytest.fixture(autouse=True)
def _bound_memory_maps():
    """Also drop them mid-module when the process nears the kernel's memory-map limit."""
    yield
    if _memory_map_count() > _MAP_LIMIT:
        jaxspec.clear_caches()


@pytest.fixture(scope="session")
def tiny_model():
    return jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def smollm2_path():
    return jaxspec.example_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return jaxspec.load(smollm2_path)


class CompileCounter:
    """Counts the executables JAX had to produce while active (jax.monitoring events).

    JAX records this event around the persistent-cache lookup as well as around a compilation, so
    an executable served by the session's cache counts too (tests/test_compile_counter.py).
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.names: list = []   # the compiled functions' names, where JAX gives them (for failure messages)

    def _listener(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1
            self.names.append(kwargs.get("fun_name"))

    def __enter__(self):
        # JAX's own key-seeding program (`jax.random.key`, which a call with a seed not seen before
        # runs: `sampling._base_key` keeps the keys of seeds seen) is built first: a module's
        # teardown drops compiled programs and those keys (`_free_compiled_programs`), and a new
        # seed after it compiled `jit(stage)` and `jit(_threefry_seed)` inside a counted call,
        # programs that are not the library's and that it compiles once per process, not per call.
        jax.random.key(0)
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


@pytest.fixture
def compile_counter():
    return CompileCounter


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def is_sharded(array) -> bool:
    """True if no single device holds the whole array."""
    largest = max(np.prod(s.data.shape) for s in array.addressable_shards)
    return not array.sharding.is_fully_replicated and largest < array.size


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, tiny_model):
    """The tiny random model as a jaxspec checkpoint folder (no tokenizer: token-id prompts)."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_model.save(path)
    return str(path)
