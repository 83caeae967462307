"""TETRIS selection against brute force and the paper's heap; packed verification against padded."""

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import tetris
from jaxspec.models.model import forward, forward_packed

NEG_INF = -np.inf
# One compiled program per (shape, capacity) instead of one per primitive: the loops below try dozens.
select_jit = jax.jit(tetris.select, static_argnums=1)
forward_jit = jax.jit(forward, static_argnums=0)


def random_instance(rng, n, k):
    """Log acceptance estimates with masked rows, masked tails and frequent ties."""
    if rng.random() < 0.3:  # coarse values: many exact ties between rows and positions
        lp = np.log(rng.choice([0.25, 0.5, 1.0], size=(n, k)))
    else:
        lp = np.log(rng.uniform(0.05, 1.0, size=(n, k)))
    limit = rng.integers(0, k + 1, size=n)          # usable prefix of each row
    lp[np.arange(k)[None, :] >= limit[:, None]] = NEG_INF
    return lp.astype(np.float32)


def cumulative(lp):
    return np.cumsum(lp.astype(np.float64), axis=1)


def usable_counts(lp):
    return np.isfinite(cumulative(lp)).sum(axis=1)


def value(lp, counts):
    cum = np.exp(cumulative(lp))
    return sum(cum[i, :c].sum() for i, c in enumerate(counts))


def brute_force_best(lp):
    """{size: max expected accepted tokens over every prefix-shaped selection of exactly size slots}."""
    best = {}
    for c in itertools.product(*(range(u + 1) for u in usable_counts(lp))):
        best[sum(c)] = max(best.get(sum(c), -np.inf), value(lp, c))
    return best


def heap_select(lp, capacity):
    """The paper's algorithm: pop the row whose next slot has the largest cumulative probability."""
    cum = cumulative(lp)
    counts = [0] * lp.shape[0]
    heap = [(-cum[i, 0], i) for i in range(lp.shape[0]) if lp.shape[1] and np.isfinite(cum[i, 0])]
    heapq.heapify(heap)
    for _ in range(capacity):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < lp.shape[1] and np.isfinite(cum[i, counts[i]]):
            heapq.heappush(heap, (-cum[i, counts[i]], i))
    return counts


@pytest.mark.parametrize("n, k", [(1, 1), (1, 5), (2, 3), (3, 2), (3, 4), (4, 3), (4, 5)])
def test_select_is_optimal_and_matches_the_heap(n, k):
    rng = np.random.default_rng(10 * n + k)
    instances = [random_instance(rng, n, k) for _ in range(40)]
    best = [brute_force_best(lp) for lp in instances]   # each selection's value computed once
    for capacity in range(n * k + 2):
        for lp, best_of_size in zip(instances, best):
            counts = np.asarray(select_jit(jnp.asarray(lp), capacity))
            usable = usable_counts(lp)
            assert counts.dtype == np.int32
            assert counts.sum() == min(capacity, usable.sum())
            assert np.all(counts <= usable), "a masked slot was chosen"
            got = value(lp, counts)
            assert got == pytest.approx(best_of_size[int(counts.sum())], rel=1e-5, abs=1e-6)
            assert got == pytest.approx(value(lp, heap_select(lp, capacity)), rel=1e-5, abs=1e-6)


def test_selected_slots_are_the_top_of_the_grid_and_prefixes_under_ties():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n, k = rng.integers(1, 6), rng.integers(1, 6)
        lp = random_instance(rng, n, k)
        capacity = int(rng.integers(0, n * k + 1))
        counts = np.asarray(select_jit(lp, capacity))
        cum = cumulative(lp)
        inside = np.arange(k)[None, :] < counts[:, None]
        # Counts are prefixes by construction; the chosen set must also be an upper set of the grid.
        if inside.any() and (~inside & np.isfinite(cum)).any():
            assert cum[inside].min() >= cum[~inside & np.isfinite(cum)].max() - 1e-6


def test_equal_confidences_split_the_budget_evenly_first_rows_first():
    lp = np.zeros((5, 4), np.float32)
    for capacity in range(21):
        counts = np.asarray(select_jit(lp, capacity))
        assert counts.max() - counts.min() <= 1
        assert list(counts) == sorted(counts, reverse=True)
        assert counts.sum() == capacity


def test_capacity_edges():
    lp = np.log(np.array([[0.9, 0.8, 0.7], [0.5, 0.4, 0.3]], np.float32))
    lp[1, 2] = NEG_INF
    assert np.asarray(tetris.select(lp, 0)).tolist() == [0, 0]
    assert np.asarray(tetris.select(lp, 5)).tolist() == [3, 2]       # everything usable
    assert np.asarray(tetris.select(lp, 100)).tolist() == [3, 2]     # more than the grid
    # 0.9, 0.72, 0.504 (row 0) against 0.5, 0.2 (row 1)
    assert np.asarray(tetris.select(lp, 3)).tolist() == [3, 0]
    assert np.asarray(tetris.select(lp, 4)).tolist() == [3, 1]
    everything_masked = np.full((3, 2), NEG_INF, np.float32)
    assert np.asarray(tetris.select(everything_masked, 4)).tolist() == [0, 0, 0]


def test_out_of_range_estimates_keep_prefix_shape():
    # A calibrated estimate could exceed 1 or be nan: clipped to 1, nan treated as unusable.
    lp = np.array([[-1.0, 0.5, -0.1], [np.nan, -0.1, -0.1], [-0.2, -0.2, -0.2]], np.float32)
    counts = np.asarray(tetris.select(lp, 4)).tolist()
    assert counts[1] == 0 and sum(counts) == 4
    assert counts == [1, 0, 3]  # row 0: -1, -1, -1.1; row 2: -0.2, -0.4, -0.6


def test_budget_inside_a_compiled_capacity(compile_counter):
    rng = np.random.default_rng(5)
    lp = jnp.asarray(random_instance(rng, 6, 4))
    select = jax.jit(tetris.select, static_argnums=1)
    select(lp, 16, jnp.int32(0)).block_until_ready()
    with compile_counter() as counter:
        got = [np.asarray(select(lp, 16, jnp.int32(budget))) for budget in range(17)]
    assert counter.count == 0
    for budget in range(17):
        np.testing.assert_array_equal(got[budget], np.asarray(select_jit(lp, budget)))


@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_bad_capacity_is_rejected(bad):
    with pytest.raises(ValueError, match="capacity must be a static int >= 0"):
        tetris.select(np.zeros((2, 2), np.float32), bad)


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError, match=r"draft_logprobs must have shape \[rows, slots\]"):
        tetris.select(np.zeros((2, 2, 2), np.float32), 1)


# --- packed verification ---

@pytest.fixture(scope="module")
def gqa_model():
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=64, attention_bias=True, name="tiny-bias")
    return jaxspec.Model.random(cfg, seed=7)


def prefilled_cache(model, lengths, max_len, rng):
    b = len(lengths)
    tokens = rng.integers(0, model.config.vocab_size, (b, max(lengths))).astype(np.int32)
    cache = model.init_cache(b, max_len)
    _, cache = forward_jit(model.graphdef, model.params, jnp.asarray(tokens), cache)
    return cache.commit(jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("slack", [0, 5])
def test_packed_verification_equals_padded(gqa_model, slack):
    rng = np.random.default_rng(slack)
    lengths, w = [3, 9, 1, 6, 12], 5
    cache = prefilled_cache(gqa_model, lengths, 32, rng)
    window = jnp.asarray(rng.integers(0, 64, (len(lengths), w)), jnp.int32)
    counts = jnp.asarray([1, 5, 3, 2, 4], jnp.int32)
    padded_logits, padded_cache = forward_jit(gqa_model.graphdef, gqa_model.params, window, cache)
    packed = jax.jit(forward_packed, static_argnums=(0, 5))
    packed_logits, packed_cache = packed(gqa_model.graphdef, gqa_model.params, window, counts, cache,
                                         int(counts.sum()) + slack)
    for i, c in enumerate(np.asarray(counts)):
        np.testing.assert_allclose(packed_logits[i, :c], padded_logits[i, :c], rtol=2e-5, atol=2e-5)
        for layer in range(gqa_model.config.num_layers):
            written = slice(lengths[i], lengths[i] + c)
            np.testing.assert_allclose(packed_cache.k[layer][i, written], padded_cache.k[layer][i, written],
                                       rtol=2e-5, atol=2e-5)
            # Slots past the used window are not written by the packed pass.
            after = slice(lengths[i] + c, lengths[i] + w)
            np.testing.assert_array_equal(packed_cache.v[layer][i, after], cache.v[layer][i, after])


def test_packed_token_work_scales_with_the_packed_length(gqa_model):
    """The compiled program's FLOPs grow with packed_len, not with the padded window grid."""
    rng = np.random.default_rng(3)
    cache = prefilled_cache(gqa_model, [4, 4, 4, 4], 32, rng)
    window = jnp.zeros((4, 8), jnp.int32)
    counts = jnp.ones((4,), jnp.int32)

    def flops(packed_len):
        lowered = jax.jit(forward_packed, static_argnums=(0, 5)).lower(
            gqa_model.graphdef, gqa_model.params, window, counts, cache, packed_len)
        return lowered.compile().cost_analysis()["flops"]

    padded = jax.jit(forward, static_argnums=0).lower(gqa_model.graphdef, gqa_model.params, window, cache)
    f8, f16, f24 = flops(8), flops(16), flops(24)
    assert f16 - f8 == pytest.approx(f24 - f16, rel=0.05)       # linear in the packed length
    per_token = (f16 - f8) / 8
    assert padded.compile().cost_analysis()["flops"] > f8 + 20 * per_token  # 32 padded tokens cost more
