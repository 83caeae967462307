"""Speculative decoding: lossless against the target's own generation, for every drafter."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts
from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models

import jaxspec
from jaxspec.drafting import ModelDrafter
from jaxspec.sampling import SamplingConfig

SMALL_VOCAB = 16


@pytest.fixture(scope="module")
def small():
    """A target, an unrelated draft and a 3-level chain's middle model, vocabulary 16."""
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=SMALL_VOCAB, name="tiny-v16")
    target = jaxspec.Model.random(cfg, seed=0)
    draft = jaxspec.Model.random(cfg.replace(num_layers=1, name="draft"), seed=3)
    smallest = jaxspec.Model.random(cfg.replace(num_layers=1, hidden_size=32, intermediate_size=64,
                                                name="smallest"), seed=2)
    return target, draft, smallest


def ragged_prompts(vocab, seed=0):
    return random_prompts(np.random.default_rng(seed), [1, 4, 9, 17, 6, 12], vocab)


def eos_hit_by_some_rows(model, prompts, max_new):
    """A token that some, not all, rows of the target's greedy output emit mid-way."""
    free = jaxspec.generate(model, prompts, max_new_tokens=max_new).tokens
    for token, _ in Counter(t for row in free for t in row[2:]).most_common():
        rows = sum(token in row[1:-2] for row in free)
        if 0 < rows < len(prompts):
            return token
    raise AssertionError("no suitable eos token")


def check_greedy_lossless(target, draft, ks, prompts, max_new=20, **spec_kwargs):
    """Speculative greedy output == the target's own, with an eos some rows hit; stats per spec.

    `ks` are draft lengths, or whole SpecConfigs; `spec_kwargs` go to SpecConfig(k=...)."""
    eos = eos_hit_by_some_rows(target, prompts, max_new)
    want = jaxspec.generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos).tokens
    assert any(len(row) < max_new for row in want) and any(len(row) == max_new for row in want)
    results = {}
    for k in ks:
        spec = k if isinstance(k, jaxspec.SpecConfig) else jaxspec.SpecConfig(k=k, **spec_kwargs)
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
        got = decoder.generate(prompts, max_new_tokens=max_new, eos_token_id=eos)
        assert got.tokens == want, spec
        results[k] = got.stats
    return results


@pytest.mark.slow  # 30 s; standard greedy also in test_batching
def test_greedy_lossless_draft_equals_target(small):
    target = small[0]
    stats_by_k = check_greedy_lossless(target, target, range(1, 7), ragged_prompts(SMALL_VOCAB))
    for k, s in stats_by_k.items():
        assert s.acceptance_rate == 1.0, k


@pytest.mark.slow  # 25 s; standard greedy also in test_batching
def test_greedy_lossless_unrelated_draft(small):
    target, draft, _ = small
    stats_by_k = check_greedy_lossless(target, draft, range(1, 7), ragged_prompts(SMALL_VOCAB, 1))
    rates = [s.acceptance_rate for s in stats_by_k.values()]
    assert np.mean(rates) > 0.01 and max(rates) < 0.6, rates


@pytest.mark.slow  # 35 s; chains also in test_batching
def test_greedy_lossless_three_level_chain(small):
    target, middle, smallest = small
    prompts = ragged_prompts(SMALL_VOCAB, 2)
    for inner_k, ks in ((1, (1, 4, 6)), (3, (2, 3, 5))):
        chain = jaxspec.SpeculativeDecoder(middle, smallest, spec=jaxspec.SpecConfig(k=inner_k))
        check_greedy_lossless(target, chain, ks, prompts)


@pytest.mark.slow  # real model, a minute
def test_greedy_lossless_ngram_on_smollm2(smollm2):
    text = ("Roses are red, violets are blue. Roses are red, violets are blue. Roses are red, "
            "violets are")
    prompts = [smollm2.tokenizer(text)["input_ids"], smollm2.tokenizer("1, 2, 3, 4, 5, 6,")["input_ids"],
               smollm2.tokenizer("The cat sat on the mat. The cat sat on the")["input_ids"]]
    stats_by_k = check_greedy_lossless(smollm2, jaxspec.NgramDrafter(max_ngram=3), (1, 3, 6), prompts,
                                       max_new=24)
    assert all(s.acceptance_rate > 0.2 for s in stats_by_k.values())


def tetris_specs():
    """TETRIS at the standard budget, a tight one, zero and more than the grid."""
    return [jaxspec.SpecConfig(k=k, extra=extra, selection="tetris", capacity=capacity)
            for k, extra, capacity in [(1, 1, None), (2, 2, None), (3, 1, None), (4, 3, None), (2, 3, 3),
                                       (3, 2, 1), (2, 1, 0), (2, 2, 100)]]


@pytest.mark.slow  # a minute; TETRIS greedy also in test_batching and test_tetris
def test_greedy_lossless_tetris(small):
    target, draft, _ = small
    for d, seed in ((target, 1), (draft, 2)):
        stats_by_spec = check_greedy_lossless(target, d, tetris_specs(), ragged_prompts(SMALL_VOCAB, seed))
        for spec, s in stats_by_spec.items():
            rows, k = 6, spec.k
            budget = rows * k if spec.capacity is None else spec.capacity
            # Never more drafts verified per step than the budget allows.
            assert s.verified_tokens <= budget * s.steps, spec
            if d is target and s.verified_tokens:
                assert s.vsr == 1.0, spec


@pytest.mark.slow  # chains of TETRIS decoders; chains also in test_batching
def test_greedy_lossless_tetris_chains(small):
    target, middle, smallest = small
    prompts = ragged_prompts(SMALL_VOCAB, 3)
    for inner in (jaxspec.SpecConfig(k=2), jaxspec.SpecConfig(k=2, extra=2, selection="tetris", capacity=5)):
        chain = jaxspec.SpeculativeDecoder(middle, smallest, spec=inner)
        check_greedy_lossless(target, chain, [tetris_specs()[i] for i in (1, 4, 5)], prompts)


@pytest.mark.slow  # real model, a minute
def test_greedy_lossless_tetris_ngram_on_smollm2(smollm2):
    prompts = [smollm2.tokenizer(text)["input_ids"] for text in (
        "one two three four, one two three four, one two three four, one two",
        "The cat sat on the mat. The cat sat on the",
        "Roses are red, violets are blue. Roses are red, violets are")]
    for capacity in (None, 2):
        stats_by_k = check_greedy_lossless(smollm2, jaxspec.NgramDrafter(max_ngram=3), [2, 4], prompts, max_new=24,
                                           selection="tetris", extra=2, capacity=capacity)
        assert all(s.vsr > 0.2 for s in stats_by_k.values())


@pytest.mark.slow  # 21 s
def test_greedy_lossless_where_the_draft_window_spills_past_the_output_bucket(small):
    """Budgets at a bucket's edge (16: the window needs slots past the output bucket) and just
    under it (13: it fits) with the cache `engine.cache_length` sizes; a chain whose inner window
    (k = 4) reaches past the outer one (k = 1). Output equals the target's greedy output."""
    from jaxspec.engine.plans import cache_length

    target, draft, smallest = small
    prompts = ragged_prompts(SMALL_VOCAB, 4)[:4]
    chain = jaxspec.SpeculativeDecoder(draft, smallest, spec=jaxspec.SpecConfig(k=4))
    for max_new in (13, 16):
        want = jaxspec.generate(target, prompts, max_new_tokens=max_new).tokens
        for d, spec in ((draft, jaxspec.SpecConfig(k=5)),
                        (draft, jaxspec.SpecConfig(k=3, extra=2, selection="tetris", capacity=6)),
                        (chain, jaxspec.SpecConfig(k=1)))[:3 if max_new == 16 else 2]:
            got = jaxspec.SpeculativeDecoder(target, d, spec=spec).generate(prompts, max_new_tokens=max_new)
            assert got.tokens == want, (max_new, spec)
    # A row's last verify window ends max_new + k slots past its prompt: always inside the cache,
    # which is no larger than the autoregressive loop's where the bucket has room for the window.
    for out_len, max_new, k in ((16, 13, 2), (16, 16, 2), (32, 20, 6), (128, 96, 6), (128, 128, 1)):
        slots = cache_length(32, out_len, max_new, k) - 32
        assert slots >= max_new + k + 1 and (slots == out_len or out_len < max_new + k + 1)


def test_k_zero_is_plain_decoding(small):
    target, draft, _ = small
    prompts = ragged_prompts(SMALL_VOCAB, 3)
    got = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=0)).generate(prompts, max_new_tokens=9)
    assert got.tokens == jaxspec.generate(target, prompts, max_new_tokens=9).tokens
    assert got.stats.drafted_tokens == 0 and got.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=8)],
                         ids=["greedy", "sampled"])
def test_the_plain_step_is_the_general_steps_k_zero_case(small, sampling):
    """`engine.plain_step` (the lean k = 0 step) against the general step path with no drafts
    (forced by recording emission probabilities, as a chain level does): the same tokens, cache
    lengths, done flags and counters after each of 9 steps, with ragged budgets and an eos."""
    import jax

    from jaxspec.engine import step as engine
    from jaxspec.engine.plans import TARGET_ONLY, Program, StepPlan
    from jaxspec.sampling import request_keys

    target, _, _ = small
    prompts = ragged_prompts(SMALL_VOCAB, 5)
    b, width, out_len = len(prompts), max(map(len, prompts)), 10
    tokens = jnp.asarray([row + [0] * (width - len(row)) for row in prompts], jnp.int32)
    lengths = jnp.asarray([len(row) for row in prompts], jnp.int32)
    max_new = jnp.asarray([3, 8, 5, 9, 2, 6], jnp.int32)
    keys = request_keys(7, np.arange(b))
    eos = jnp.int32(eos_hit_by_some_rows(target, prompts, 9) if sampling.greedy else 3)
    cache_len = width + out_len + 8
    program = Program(target=target.graphdef, drafter=None, schedule=TARGET_ONLY, sampling=sampling,
                      cache_len=cache_len, out_len=out_len)
    requests = engine.Requests(tokens_bp=tokens, prompt_len_b=lengths, max_new_b=max_new, keys_b=keys, eos_id=eos)
    state, _ = engine.initial_state(program, target.params, requests)
    general = state.replace(probs_bov=jnp.zeros((b, out_len, SMALL_VOCAB)), logprob_bo=jnp.zeros((b, out_len)))
    recording = Program(target=target.graphdef, drafter=None, schedule=TARGET_ONLY, sampling=sampling, record=True)
    lean = state
    for _ in range(9):
        general = engine.verify_phase(recording, StepPlan(k=0), (target.params, ()), general,
                                      engine.empty_proposal(b))
        lean = engine.plain_step(program, (target.params, ()), lean)
        for name in ("seq_bl", "out_bo", "n_out_b", "done_b", "steps"):
            np.testing.assert_array_equal(getattr(lean, name), getattr(general, name), err_msg=name)
        np.testing.assert_array_equal(lean.target_cache.lengths, general.target_cache.lengths)
        jax.tree.map(np.testing.assert_array_equal, lean.counters, general.counters)
    done = np.asarray(lean.done_b)
    assert done.all() and (np.asarray(lean.n_out_b) < np.asarray(max_new)).any()   # some row stopped at eos


# --- sampling: the exact distribution of the first tokens on a 6-token vocabulary (exactness.py) ---

@pytest.fixture(scope="module")
def vocab6():
    return vocab6_models()


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
             SamplingConfig(temperature=1.0, top_p=0.8)]
T1, TOPK3, TOPP = SAMPLINGS


def test_sampling_lossless_plain_steps(vocab6):
    """k = 0 (the goodput policy's plain decoding) samples from the target's distribution."""
    target, draft, _ = vocab6
    rows, sampling = 4000, TOPK3
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=0), sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * rows, max_new_tokens=3, seed=23)
    assert_matches_distribution(result.tokens, exact_joint(target, VOCAB6_PROMPT, 3, sampling), rows)


# (k, sampling, rows, greedy draft). The first k + 2 tokens are compared: the prefill's token, the
# first window's k drafts (or its correction) and, after a full accept, its bonus token, so a bonus
# drawn from the wrong position changes the compared distribution. At depth 5 the full vocabulary
# pools most of the joint into rare cells, so k = 3 runs with top-k / top-p and twice the rows.
WINDOWS = [(1, T1, 4000, False), (1, TOPK3, 4000, False), (1, TOPP, 4000, False), (1, T1, 4000, True),
           (3, TOPK3, 8000, False), (3, TOPP, 8000, False), (3, TOPK3, 8000, True)]


@pytest.mark.parametrize("k, sampling, rows, greedy_draft", WINDOWS,
                         ids=["k1-t1", "k1-topk3", "k1-topp", "k1-t1-greedy-draft", "k3-topk3", "k3-topp",
                              "k3-topk3-greedy-draft"])
def test_sampling_lossless(vocab6, k, sampling, rows, greedy_draft):
    target, draft, _ = vocab6
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k, greedy_draft=greedy_draft),
                                         sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * rows, max_new_tokens=k + 2, seed=17)
    assert_matches_distribution(result.tokens, exact_joint(target, VOCAB6_PROMPT, k + 2, sampling), rows)
    assert 0 < result.stats.acceptance_rate < 1


def test_sampling_lossless_ngram_and_chain(vocab6):
    """k = 2 and four tokens: the first window's bonus is the fourth."""
    target, middle, smallest = vocab6
    sampling, rows, prompt = TOPK3, 4000, VOCAB6_PROMPT + [1, 4, 2, 5, 1, 4]
    table = exact_joint(target, prompt, 4, sampling)
    chain = jaxspec.SpeculativeDecoder(middle, smallest, spec=jaxspec.SpecConfig(k=2), sampling=sampling)
    for draft in (jaxspec.NgramDrafter(max_ngram=2), chain):
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=2), sampling=sampling)
        result = decoder.generate([prompt] * rows, max_new_tokens=4, seed=23)
        assert_matches_distribution(result.tokens, table, rows)
        assert result.stats.acceptance_rate > 0


def first_tokens(tokens, n):
    return [row[:n] for row in tokens]


TETRIS_ROWS = 4000


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-topk3", "topp0.8"])
def test_sampling_lossless_tetris(vocab6, sampling):
    """A tight budget (half a draft per row) makes the selection decide which rows verify."""
    target, draft, _ = vocab6
    spec = jaxspec.SpecConfig(k=2, extra=2, selection="tetris", capacity=TETRIS_ROWS // 2)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=sampling)
    # Six tokens, so windows are not cut by the budget; the first three are compared exactly.
    result = decoder.generate([VOCAB6_PROMPT] * TETRIS_ROWS, max_new_tokens=6, seed=19)
    table = exact_joint(target, VOCAB6_PROMPT, 3, sampling)
    assert_matches_distribution(first_tokens(result.tokens, 3), table, TETRIS_ROWS)
    assert 0 < result.stats.vsr < 1 and result.stats.mean_draft_length <= 0.5


@pytest.mark.slow  # 35 s; TETRIS sampling also in test_sampling_lossless_tetris
def test_sampling_lossless_tetris_greedy_draft_ngram_and_chain(vocab6):
    target, middle, smallest = vocab6
    sampling = SamplingConfig(temperature=1.0)
    prompt = VOCAB6_PROMPT + [1, 4, 2, 5, 1, 4]
    table = exact_joint(target, prompt, 3, sampling)
    tight = dict(k=2, extra=2, selection="tetris", capacity=TETRIS_ROWS // 2)
    chain = jaxspec.SpeculativeDecoder(middle, smallest, spec=jaxspec.SpecConfig(k=2), sampling=sampling)
    for draft, greedy_draft in ((middle, True), (jaxspec.NgramDrafter(max_ngram=2), False), (chain, False)):
        spec = jaxspec.SpecConfig(greedy_draft=greedy_draft, **tight)
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=sampling)
        result = decoder.generate([prompt] * TETRIS_ROWS, max_new_tokens=5, seed=29)
        assert_matches_distribution(first_tokens(result.tokens, 3), table, TETRIS_ROWS)


class _DrawnTokenScore(ModelDrafter):
    """The paper's score taken literally under sampling: log q of the token actually drawn."""

    def __eq__(self, other):
        return type(other) is _DrawnTokenScore and other.model.graphdef == self.model.graphdef

    def __hash__(self):
        return hash((_DrawnTokenScore, self.model.graphdef))

    def propose(self, *args):
        proposal, state = super().propose(*args)
        drawn = jnp.take_along_axis(proposal.q_bkv, proposal.tokens_bk[..., None], axis=-1)[..., 0]
        return proposal.replace(logprob_bk=jnp.log(drawn)), state


def test_scoring_the_drawn_token_would_bias_sampling(vocab6):
    """Why `draft_logprob` scores a random draw by its expectation: with the drawn token's own
    probability deciding whether it is verified, the output distribution is measurably wrong."""
    target, draft, _ = vocab6
    sampling = SamplingConfig(temperature=1.0)
    spec = jaxspec.SpecConfig(k=2, extra=2, selection="tetris", capacity=TETRIS_ROWS // 2)
    decoder = jaxspec.SpeculativeDecoder(target, _DrawnTokenScore(draft), spec=spec, sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * TETRIS_ROWS, max_new_tokens=3, seed=17)
    with pytest.raises(AssertionError):
        assert_matches_distribution(result.tokens, exact_joint(target, VOCAB6_PROMPT, 3, sampling), TETRIS_ROWS)


# --- statistics and compilation ---

@pytest.mark.slow
def test_statistics_when_draft_equals_target(small):
    target = small[0]
    prompts = ragged_prompts(SMALL_VOCAB, 4)
    for k in (2, 5):
        steps = 4
        result = jaxspec.SpeculativeDecoder(target, target, spec=jaxspec.SpecConfig(k=k)).generate(
            prompts, max_new_tokens=1 + steps * (k + 1))
        s = result.stats
        n = len(prompts)
        assert s.acceptance_rate == 1.0 and s.vsr == 1.0 and s.ter == 1.0
        assert s.mean_accepted_length == k + 1
        assert s.steps == steps and s.target_forwards == steps + 1
        assert s.drafted_tokens == s.verified_tokens == s.accepted_tokens == n * steps * k
        assert s.new_tokens == sum(map(len, result.tokens)) == n * (1 + steps * (k + 1))
        assert s.mean_draft_length == k


def test_counts_add_up(small):
    target, draft, _ = small
    prompts = ragged_prompts(SMALL_VOCAB, 5)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=3))
    result = decoder.generate(prompts, max_new_tokens=15)
    s = result.stats
    accepted = s.extra["per_request_accepted"]
    steps = s.extra["per_request_steps"]
    for tokens, a, st in zip(result.tokens, accepted, steps):
        # emitted = first token + accepted drafts + one correction/bonus per step, minus what the
        # budget cut off in the last step (at most k).
        assert 0 <= 1 + a + st - len(tokens) <= 3
    assert s.accepted_tokens == sum(accepted)
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)


_COST = jaxspec.CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-4, target_fixed=5e-3,
                                            target_per_token=2e-4)


@pytest.mark.parametrize("spec", [jaxspec.SpecConfig(k=3),
                                  jaxspec.SpecConfig(k=3, extra=2, selection="tetris"),
                                  pytest.param(jaxspec.SpecConfig(k=2, extra=1, selection="tetris", policy="goodput",
                                                                  cost_model=_COST), marks=pytest.mark.slow)],
                         ids=["standard", "tetris", "tetris-goodput"])
def test_no_recompilation_after_warmup(small, compile_counter, spec):
    target, draft, _ = small
    # 6 then 7 prompts: one batch bucket, budgets 18 and 21 in one capacity bucket.
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=SamplingConfig(temperature=0.9))
    decoder.generate(ragged_prompts(SMALL_VOCAB, 6), max_new_tokens=20, seed=0)
    with compile_counter() as counter:
        decoder.generate(ragged_prompts(SMALL_VOCAB, 7) + [[1, 2]], max_new_tokens=18, seed=1, eos_token_id=3)
    assert counter.count == 0


@pytest.mark.slow  # 15 s; a compile-time saving, not a behaviour
def test_fixed_decoders_of_every_draft_length_share_one_prefill_program(small, compile_counter):
    """Only a decoder's loop depends on its draft length: after k = 2 has run, a new decoder with
    k = 3 (and a TETRIS one drafting as many, so its cache is as large) compiles its loop and
    nothing else, and both still reproduce the target's greedy output."""
    target, draft, _ = small
    prompts = ragged_prompts(SMALL_VOCAB, 5)
    reference = jaxspec.generate(target, prompts, max_new_tokens=12).tokens
    first = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=2)).generate(prompts,
                                                                                           max_new_tokens=12)
    assert first.tokens == reference
    for spec in (jaxspec.SpecConfig(k=3), jaxspec.SpecConfig(k=2, extra=1, selection="tetris")):
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
        with compile_counter() as counter:
            result = decoder.generate(prompts, max_new_tokens=12)
        assert result.tokens == reference, spec
        assert counter.count == 1, (spec, counter.count)


# --- bad input ---

def test_vocabulary_mismatch_names_both_sizes(small, tiny_model):
    with pytest.raises(ValueError, match=r"draft vocab_size \(256\) differs from the target's vocab_size \(16\)"):
        jaxspec.SpeculativeDecoder(small[0], tiny_model)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(k=-1), "k must be an int >= 0"),
    (dict(k=17), "larger than the compiled maximum"),
    (dict(capacity=-2), "capacity"),
    (dict(selection="best"), "selection"),
    (dict(policy="goodput"), "cost_model"),
    (dict(k=0, policy="goodput", cost_model=jaxspec.CostModel.from_coefficients(
        draft_fixed=1e-3, draft_per_token=0.0, target_fixed=5e-3, target_per_token=0.0)), "needs k >= 1"),
])
def test_bad_spec_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        jaxspec.SpecConfig(**kwargs)


def test_bad_prompts_are_rejected_like_generate(small):
    decoder = jaxspec.SpeculativeDecoder(small[0], small[1], spec=jaxspec.SpecConfig(k=2))
    with pytest.raises(ValueError, match="prompts is empty"):
        decoder.generate([])
    with pytest.raises(ValueError, match="token id 16, outside"):
        decoder.generate([[16]])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        decoder.generate([[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="draft must be"):
        jaxspec.SpeculativeDecoder(small[0], "ngram")


# --- threshold drafting ---

@pytest.mark.slow  # 26 s; threshold drafting stays in the default suite through its sampling test
def test_greedy_lossless_threshold_drafting(small):
    target, draft, smallest = small
    prompts = ragged_prompts(SMALL_VOCAB, 8)
    lengths = {}
    for threshold in (0.9, 0.01):
        specs = [jaxspec.SpecConfig(k=5, threshold=threshold),
                 jaxspec.SpecConfig(k=4, extra=2, selection="tetris", threshold=threshold)]
        stats_by_spec = check_greedy_lossless(target, draft, specs, prompts)
        standard, packed = stats_by_spec.values()
        # Standard selection still verifies k slots, but only a window's drafts count as drafted;
        # TETRIS verifies only what the windows hold.
        lengths[threshold] = (standard.drafted_tokens / sum(standard.extra["per_request_steps"]),
                              packed.mean_draft_length)
    for i in range(2):  # a lower threshold keeps longer windows
        assert lengths[0.9][i] < lengths[0.01][i], lengths
    chain = jaxspec.SpeculativeDecoder(draft, smallest, spec=jaxspec.SpecConfig(k=3, threshold=0.2))
    check_greedy_lossless(target, chain, [jaxspec.SpecConfig(k=3, threshold=0.2)], prompts)


def test_sampling_lossless_threshold_drafting(vocab6):
    target, draft, _ = vocab6
    sampling = SamplingConfig(temperature=1.0)
    spec = jaxspec.SpecConfig(k=3, threshold=0.35)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * TETRIS_ROWS, max_new_tokens=5, seed=31)
    table = exact_joint(target, VOCAB6_PROMPT, 3, sampling)
    assert_matches_distribution(first_tokens(result.tokens, 3), table, TETRIS_ROWS)
    assert 0 < result.stats.drafted_tokens < 3 * sum(result.stats.extra["per_request_steps"])


@pytest.mark.parametrize("kind", ["model", "eagle", "chain"])
def test_compiled_programs_do_not_keep_the_drafts_weights(tiny_model, kind):
    """A drafter is a static argument of the compiled programs, which JAX's caches keep alive:
    the engine passes a weightless twin (`Drafter.static`), so a decoder's draft weights are freed
    with the decoder."""
    import gc
    import weakref
    draft = jaxspec.Model.random(tiny_model.config.replace(num_layers=1), seed=11)
    weights = [weakref.ref(x) for x in jax.tree.leaves(draft.params)]
    if kind == "eagle":
        draft = jaxspec.EagleDrafter(jaxspec.EagleHead.init(tiny_model, seed=1))
        weights = [weakref.ref(x) for x in jax.tree.leaves(draft.head.params)]
    elif kind == "chain":
        draft = jaxspec.SpeculativeDecoder(draft, jaxspec.NgramDrafter(), spec=jaxspec.SpecConfig(k=2))
    decoder = jaxspec.SpeculativeDecoder(tiny_model, draft, spec=jaxspec.SpecConfig(k=2))
    want = jaxspec.generate(tiny_model, [[1, 2, 3, 4]], max_new_tokens=6).tokens
    assert decoder.generate([[1, 2, 3, 4]], max_new_tokens=6).tokens == want
    del decoder, draft
    gc.collect()
    assert all(ref() is None for ref in weights)
