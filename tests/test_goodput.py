"""Decoding under the goodput policy (`SpecConfig(policy="goodput")`): lossless against the
target's own output (greedy) and distribution (chi-square), and the plans it runs where the
cost model makes drafting free or dear."""

import dataclasses

import numpy as np
import pytest

import jaxspec
from jaxspec.policy.cost import CostModel


@pytest.fixture(scope="module")
def pair():
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=16, name="tiny-v16")
    return jaxspec.Model.random(cfg, seed=0), jaxspec.Model.random(cfg.replace(num_layers=1, name="d"), seed=3)


def prompts16(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 16, n).tolist() for n in (1, 4, 9, 17, 6, 12)]


BALANCED = CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-4, target_fixed=5e-3,
                                       target_per_token=5e-4)


@pytest.mark.slow   # greedy goodput decoding stays in the default suite through test_batching and test_engine
@pytest.mark.parametrize("selection", ["standard", "tetris"])
def test_goodput_policy_is_lossless(pair, selection):
    target, draft = pair
    del draft   # a perfect drafter and a poor one (the switch to plain steps and back)
    for d, seed in ((target, 0), (jaxspec.NgramDrafter(max_ngram=2), 2)):
        prompts = prompts16(seed)
        want = jaxspec.generate(target, prompts, max_new_tokens=24).tokens
        spec = jaxspec.SpecConfig(k=4, extra=2 if selection == "tetris" else 0, selection=selection,
                                  policy="goodput", cost_model=BALANCED)
        got = jaxspec.SpeculativeDecoder(target, d, spec=spec).generate(prompts, max_new_tokens=24)
        assert got.tokens == want
        assert len(got.stats.extra["k_trace"]) == got.stats.steps
        assert sum(steps for _, steps in got.stats.extra["segments"]) == got.stats.steps


@pytest.mark.slow  # 33 s; the policy's choices are judged in test_policy / test_policy_sim
def test_goodput_policy_switches_off_for_an_expensive_draft_and_maxes_a_perfect_free_one(pair):
    target, draft = pair
    prompts = prompts16(4)
    want = jaxspec.generate(target, prompts, max_new_tokens=20).tokens
    expensive = CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.0, target_fixed=5e-3,
                                            target_per_token=5e-4)
    got = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(
        k=4, policy="goodput", cost_model=expensive)).generate(prompts, max_new_tokens=20)
    assert got.tokens == want and set(got.stats.extra["k_trace"]) == {0} and got.stats.drafted_tokens == 0
    assert {plan for plan, _ in got.stats.extra["segments"]} == {0}     # plain decoding to the end
    free = CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=5e-3, target_per_token=1e-5)
    got = jaxspec.SpeculativeDecoder(target, target, spec=jaxspec.SpecConfig(
        k=4, policy="goodput", cost_model=free)).generate(prompts, max_new_tokens=20)
    assert got.tokens == want and set(got.stats.extra["k_trace"]) == {4}


@pytest.mark.slow   # 36 s per case (suite time)
@pytest.mark.parametrize("selection", ["standard", "tetris"])
def test_goodput_policy_is_lossless_under_sampling(selection):
    """Exact distribution of the first four tokens (a k = 2 window's bonus is the fourth) on a
    6-token vocabulary, with the plan changing within the run: the optimistic prior opens with
    drafting, the measured acceptance (about 0.5) does not pay for this draft cost, and the
    counts' ageing probes drafting again now and then."""
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models

    target, draft, _ = vocab6_models()
    sampling = jaxspec.SamplingConfig(temperature=0.7, top_k=3)
    rows = 4000
    cost = CostModel.from_coefficients(draft_fixed=2.8e-3, draft_per_token=1e-9, target_fixed=5e-3,
                                       target_per_token=1e-6)
    spec = jaxspec.SpecConfig(k=2 if selection == "standard" else 1, extra=1 if selection == "tetris" else 0,
                              selection=selection, policy="goodput", cost_model=cost)
    result = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=sampling).generate(
        [VOCAB6_PROMPT] * rows, max_new_tokens=6, seed=37, batch_size=1000)
    assert_matches_distribution([t[:4] for t in result.tokens], exact_joint(target, VOCAB6_PROMPT, 4, sampling), rows)
    trace = result.stats.extra["k_trace"]
    assert 0 in trace and max(trace) > 0, trace   # drafting and plain steps both emitted tokens


class BlindNgram(jaxspec.NgramDrafter):
    """n-gram lookup without its forecast (compiled apart: another class)."""

    free = False

    def bind_vocab(self, vocab_size):
        return BlindNgram(self.max_ngram, self.min_ngram, vocab_size)


def test_goodput_decodes_plainly_where_a_free_drafter_forecasts_nothing(pair):
    """Rows where no earlier trigram matches the last three tokens (brute force over the greedy output)
    get no n-gram proposal: reading the drafter's forecast, the policy never drafts for them, though its
    optimistic prior alone (what it drafts by without a forecast) makes a verification worth three steps."""
    target, _ = pair
    rng = np.random.default_rng(7)
    prompts = [rng.permutation(16)[:12].tolist() for _ in range(24)]
    outputs = jaxspec.generate(target, prompts, max_new_tokens=8).tokens

    def matched(seq, i):   # a 3-gram proposal exists for pending position i
        return any(seq[j - 2:j + 1] == seq[i - 2:i + 1] for j in range(2, i))

    bare = [p for p, out in zip(prompts, outputs)
            if not any(matched(p + out, i) for i in range(len(p) - 1, len(p) + len(out) - 1))]
    assert len(bare) >= 2, "the test needs rows with nothing to match"
    dear = CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1e-2, target_per_token=1e-6,
                                       speculation_fixed=2e-2)
    spec = jaxspec.SpecConfig(k=4, policy="goodput", cost_model=dear)
    drafter = jaxspec.NgramDrafter(max_ngram=3, min_ngram=3)
    got = jaxspec.SpeculativeDecoder(target, drafter, spec=spec).generate(bare, max_new_tokens=8)
    assert got.tokens == jaxspec.generate(target, bare, max_new_tokens=8).tokens
    assert set(got.stats.extra["k_trace"]) == {0}
    blind = jaxspec.SpeculativeDecoder(target, BlindNgram(3, 3), spec=spec).generate(bare, max_new_tokens=8)
    assert blind.tokens == got.tokens, (blind.tokens, got.tokens)
    assert max(blind.stats.extra["k_trace"]) > 0


def test_a_free_drafter_is_priced_by_the_cost_models_free_part(pair):
    """A cost model profiled with a draft model charges every drafting step that model's forwards;
    an n-gram drafter pays none of them. With the profile of the target alone as `free` (`jaxspec
    profile --free`), the policy prices the n-gram plans by it and drafts on prompts that repeat;
    without it, the same drafter never drafts."""
    target, _ = pair
    prompts = [[3, 1, 4, 1, 5] * 4, [2, 7, 1, 8] * 5]
    costly = CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.0, target_fixed=1e-2,
                                         target_per_token=1e-6)
    free = CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1e-2, target_per_token=1e-6)
    want = jaxspec.generate(target, prompts, max_new_tokens=8).tokens
    traces = []
    for cost in (costly, dataclasses.replace(costly, free=free)):
        spec = jaxspec.SpecConfig(k=3, policy="goodput", cost_model=cost)
        got = jaxspec.SpeculativeDecoder(target, jaxspec.NgramDrafter(max_ngram=3), spec=spec).generate(
            prompts, max_new_tokens=8)
        assert got.tokens == want
        traces.append(set(got.stats.extra["k_trace"]))
    assert traces[0] == {0} and max(traces[1]) > 0, traces
