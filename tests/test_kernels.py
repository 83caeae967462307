"""XLA:CPU kernels chosen per program by measurement (`jaxspec.engine.kernels`)."""

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.engine import kernels, loop


@pytest.fixture
def probing(monkeypatch, tmp_path):
    """Probing on (the suite's default is XLA's kernels), a fresh timing cache in tmp_path."""
    monkeypatch.setenv("JAXSPEC_KERNELS", "probe")
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_FILE", {})
    monkeypatch.setattr(kernels, "DECISIONS", [])
    monkeypatch.setattr(kernels, "_CHOICES", {})
    return tmp_path / "kernels.json"


def test_products_are_the_programs_matrix_products():
    """Every dot_general of a program, with its shapes and how often it occurs, against the
    products the function was written with."""
    def f(x_md, w_df, w_fd, q_bqhd, k_bkhd):
        h = jax.nn.silu(x_md @ w_df) @ w_fd
        h2 = jnp.tanh(h @ w_fd.T) @ w_fd   # [m, d] x [d, f] again, then [m, f] x [f, d] again
        return h + h2, jnp.einsum("bqhd,bkhd->bhqk", q_bqhd, k_bkhd)

    args = (jnp.ones((5, 8)), jnp.ones((8, 24)), jnp.ones((24, 8)), jnp.ones((2, 3, 4, 16)), jnp.ones((2, 7, 4, 16)))
    found = kernels.products(jax.jit(f).lower(*args).as_text())
    shapes = collections.Counter((kernels._parse(p)[1][0][0], kernels._parse(p)[1][1][0], kernels._parse(p)[2])
                                 for p in found.elements())
    assert shapes == collections.Counter({((5, 8), (8, 24), 5): 2, ((5, 24), (24, 8), 5): 2,
                                          ((2, 3, 4, 16), (2, 7, 4, 16), 3): 1})


def test_choose_takes_the_least_total_time_beyond_the_margin(probing, monkeypatch):
    """The choice is the candidate with the least count-weighted time over the products, checked
    by brute force over random timing tables; one within MARGIN of XLA's default keeps the default."""
    text = jax.jit(lambda x, w, v: (x @ w) @ v).lower(jnp.ones((3, 4)), jnp.ones((4, 6)), jnp.ones((6, 4))).as_text()
    names = list(kernels.CANDIDATES)
    rng = np.random.default_rng(0)
    for _ in range(20):
        table = {p: dict(zip(names, rng.uniform(1, 2, len(names)))) for p in kernels.products(text)}
        monkeypatch.setattr(kernels, "_timings", table.__getitem__)
        totals = {n: sum(t[n] for t in table.values()) for n in names}
        best = min(totals, key=totals.get)
        expect = best if totals[best] < (1 - kernels.MARGIN) * totals["xla"] else "xla"
        assert kernels.choose(text) == kernels.CANDIDATES[expect]


def test_probe_times_each_product_once_per_machine(probing, monkeypatch, tiny_model):
    """A decode call probes its programs' products, keeps the timings in the cache file under this
    machine's key, and a new process (an empty in-memory store) reads them instead of timing again."""
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(), spec=jaxspec.SpecConfig(k=2))
    decoder.generate(prompts, max_new_tokens=8)
    stored = json.loads(probing.read_text())[kernels.machine_key()]
    assert {d["program"] for d in kernels.DECISIONS} >= {"start_on_device", "run_on_device"}
    assert stored and all(set(times) <= set(kernels.CANDIDATES) and "xla" in times for times in stored.values())

    monkeypatch.setattr(kernels, "_FILE", {})
    monkeypatch.setattr(kernels, "_CHOICES", {})
    monkeypatch.setattr(kernels, "_seconds", lambda *a: pytest.fail("timed a product the cache holds"))
    jax.clear_caches()
    again = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(), spec=jaxspec.SpecConfig(k=2))
    again.generate(prompts, max_new_tokens=8)


@pytest.mark.parametrize("setting", [name for name in kernels.CANDIDATES if name != "xla"])
def test_every_candidate_decodes_like_xlas_kernels(monkeypatch, tiny_model, setting):
    """Greedy speculative decoding with a candidate's kernels forced equals plain decoding with
    XLA's, token for token; and the options reached the program (`dot` and the others turn YNN's
    dot fusion off, which XLA uses for a product of several rows by default)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    reference = jaxspec.generate(tiny_model, prompts, max_new_tokens=12).tokens
    monkeypatch.setenv("JAXSPEC_KERNELS", setting)
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(), spec=jaxspec.SpecConfig(k=3))
    assert decoder.generate(prompts, max_new_tokens=12).tokens == reference

    x, w = jnp.ones((5, 64)), jnp.ones((64, 32))
    forced = kernels.Probed(lambda a, b: a @ b)
    assert "__ynn_fusion" in jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text()
    assert "__ynn_fusion" not in forced.lower(x, w).compile().as_text()


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("JAXSPEC_KERNELS", "fast")
    with pytest.raises(ValueError, match="JAXSPEC_KERNELS.*'probe'.*'dot'"):
        kernels.mode()


def test_loop_programs_take_the_chosen_options(probing, monkeypatch, tiny_model):
    """The engine's programs run with the options `choose` returns for them (XLA's defaults only
    lower the program for the probe to read)."""
    chosen = kernels.CANDIDATES["dot"]
    monkeypatch.setattr(kernels, "choose", lambda text, name="": chosen)
    seen = []
    original = loop.run_on_device._jitted
    monkeypatch.setattr(loop.run_on_device, "_jitted", lambda options: seen.append(options) or original(options))
    jaxspec.generate(tiny_model, [[1, 2, 3]], max_new_tokens=4)
    assert set(seen) == {(), chosen} and seen[-1] == chosen
