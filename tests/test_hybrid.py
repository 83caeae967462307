"""HybridDrafter: each row verifies the proposal with more expected accepted drafts (against a
reference computed from each member's own proposal), a draft model kept right after another
member's proposal was taken, and lossless decoding (greedy identity, a chi-square)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models.eagle import EagleHead
from jaxspec.sampling import SamplingConfig

K, SLOTS = 4, 64


@pytest.fixture(scope="module")
def models():
    cfg = jaxspec.ModelConfig.preset("tiny")
    return jaxspec.Model.random(cfg, seed=0), jaxspec.Model.random(cfg.replace(num_layers=1), seed=4)


def rows_and_corpus():
    """Corpus documents over tokens 0..127; rows that continue one of them (the suffix drafter
    knows what follows) and rows of distinct tokens 128..255 (it knows nothing: the model's turn)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128, 30).tolist() for _ in range(4)]
    rows = [docs[i % 4][:12 + i] for i in range(4)] + [(128 + rng.permutation(128)[:14]).tolist() for _ in range(4)]
    return docs, rows


def bound_hybrid(target, draft, sampling=None):
    suffix = jaxspec.SuffixDrafter(max_depth=8, corpus_tokens=512)
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter([suffix, draft]),
                                         spec=jaxspec.SpecConfig(k=K), sampling=sampling)
    return decoder.drafter


def start(drafter, rows):
    b, p = len(rows), max(map(len, rows))
    tokens = np.zeros((b, p), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    seq = jnp.zeros((b, SLOTS), jnp.int32).at[:, :p].set(tokens)
    return drafter.init(drafter.params, jnp.asarray(tokens), lengths, SLOTS), seq, lengths - 1


def expected_accepted(logprob, num, first_only):
    reach = np.exp(logprob[:, :1] * np.arange(1, logprob.shape[1] + 1)) if first_only else np.exp(np.cumsum(logprob, 1))
    return np.where(np.arange(logprob.shape[1]) < num[:, None], reach, 0).sum(1)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "sampled"])
def test_each_row_verifies_the_proposal_with_more_expected_accepted_drafts(models, sampling):
    """Reference: each member's own proposal from the same state, scored in numpy (a sampling
    draft model by its first draft's estimate alone: its later ones depend on its draws)."""
    docs, rows = rows_and_corpus()
    hybrid = bound_hybrid(*models, sampling)
    hybrid.remember(docs)
    state, seq, pending = start(hybrid, rows)
    keys = jax.random.split(jax.random.key(3), len(rows))
    got, _ = jax.jit(lambda p, s: hybrid.propose(p, s, seq, pending, K, keys, sampling))(hybrid.params, state)
    alone = [jax.jit(lambda p, s, m=m: m.propose(p, s, seq, pending, K, keys, sampling)[0])(p, s)
             for m, p, s in zip(hybrid.members, hybrid.params, state)]
    scores = [expected_accepted(np.asarray(a.logprob_bk), np.asarray(a.num_drafts_b), i == 1 and not sampling.greedy)
              for i, a in enumerate(alone)]
    pick = np.argmax(np.stack(scores), axis=0)
    assert set(pick[:4]) == {0} and set(pick[4:]) == {1}, scores   # the rows' sources, as built
    for field in ("tokens_bk", "num_drafts_b", "logprob_bk", "q_bkv"):
        want = np.stack([np.asarray(getattr(a, field))[i] for i, a in zip(range(len(rows)), (alone[j] for j in pick))])
        np.testing.assert_allclose(np.asarray(getattr(got, field)), want, rtol=1e-6, atol=1e-6, err_msg=field)


def commit(seq, pending, proposal, accepted, token):
    """The sequences after each row accepted `accepted` drafts of `proposal`, then `token` + row."""
    seq, pending = np.asarray(seq).copy(), np.asarray(pending).copy()
    for i, a in enumerate(accepted):
        seq[i, pending[i] + 1:pending[i] + 1 + a] = np.asarray(proposal.tokens_bk)[i, :a]
        seq[i, pending[i] + 1 + a] = token + i
    return jnp.asarray(seq), jnp.asarray(pending + accepted + 1)


def test_a_draft_model_drafts_right_after_other_members_proposals_and_free_steps(models):
    """Rows verify the hybrid's proposals, accepting some of each (the suffix drafter's on half
    the rows), then a step of the suffix drafter alone (`propose_free`); after `catch_up`, the
    draft model proposes what a draft model fed the committed tokens from scratch proposes
    (without `discard` it would trust its own rejected drafts)."""
    docs, rows = rows_and_corpus()
    hybrid = bound_hybrid(*models)
    hybrid.remember(docs)
    state, seq, pending = start(hybrid, rows)
    keys, greedy = jax.random.split(jax.random.key(3), len(rows)), SamplingConfig()
    first, state = jax.jit(lambda p, s, seq, pending: hybrid.propose(p, s, seq, pending, K, keys, greedy))(
        hybrid.params, state, seq, pending)
    accepted = np.minimum(np.arange(len(rows)) % (K + 1), np.asarray(first.num_drafts_b))
    assert accepted[:4].sum() > 0 and accepted[4:].sum() > 0
    seq, pending = commit(seq, pending, first, accepted, 200)
    free, state = jax.jit(lambda p, s, seq, pending: hybrid.propose_free(p, s, seq, pending, K, keys, greedy))(
        hybrid.params, state, seq, pending)
    seq, pending = commit(seq, pending, free, np.minimum(1, np.asarray(free.num_drafts_b)), 220)
    state = jax.jit(lambda p, s, seq, pending: hybrid.catch_up(p, s, seq, pending, 16))(hybrid.params, state, seq,
                                                                                         pending)
    model = hybrid.members[1]
    model_propose = jax.jit(lambda p, s, seq, pending: model.propose(p, s, seq, pending, K, keys, greedy)[0])
    got = model_propose(hybrid.params[1], state[1], seq, pending)
    fresh_state, fresh_seq, fresh_pending = start(model, [list(seq[i, :pending[i] + 1]) for i in range(len(rows))])
    want = model_propose(model.params, fresh_state, fresh_seq, fresh_pending)
    np.testing.assert_array_equal(np.asarray(got.tokens_bk), np.asarray(want.tokens_bk))


def eagle_head(target):
    return jaxspec.EagleDrafter(EagleHead.init(target, seed=1))


@pytest.mark.parametrize("spec, member", [
    (dict(k=4), "model"), (dict(k=4), "eagle"),
    pytest.param(dict(k=3, extra=2, selection="tetris", capacity=12), "model", marks=pytest.mark.slow),
    pytest.param(dict(k=4, policy="goodput"), "model", marks=pytest.mark.slow)],
    ids=["standard", "eagle", "tetris", "goodput"])   # tetris, goodput: 40 s each
def test_hybrid_output_is_the_targets_greedy_output_across_refills_and_calls(models, spec, member):
    """Six prompts in four slots, then four of them again: the second call drafts the repeats from
    the corpus, and every output equals the target's own greedy decoding."""
    target, draft = models
    if spec.get("policy") == "goodput":
        spec["cost_model"] = jaxspec.CostModel.from_coefficients(
            draft_fixed=1e-4, draft_per_token=1e-5, target_fixed=5e-3, target_per_token=1e-5,
            target_per_context_token=0.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 3, 12, 7, 4)]
    want = jaxspec.generate(target, prompts, max_new_tokens=20).tokens
    hybrid = jaxspec.HybridDrafter([jaxspec.SuffixDrafter(max_depth=12, corpus_tokens=4096),
                                    eagle_head(target) if member == "eagle" else draft])
    decoder = jaxspec.SpeculativeDecoder(target, hybrid, spec=jaxspec.SpecConfig(**spec))
    first = decoder.generate(prompts, max_new_tokens=20, batch_size=4)
    second = decoder.generate(prompts[:4], max_new_tokens=20, batch_size=4)
    assert first.tokens == want and second.tokens == want[:4]
    assert second.stats.accepted_tokens > 2 * first.stats.accepted_tokens // 3, (first.stats, second.stats)
    repeated = sum(second.stats.extra["per_request_accepted"]) / sum(second.stats.per_request_new_tokens)
    assert repeated > 0.6, second.stats


@pytest.mark.slow   # 27 s; the free plans' draft-model bookkeeping stays in the default suite (above)
def test_goodput_lets_the_suffix_drafter_draft_alone_when_the_draft_model_costs_too_much(models):
    """A draft model priced at ten target passes a position: on repeated requests the policy runs
    the suffix drafter alone (the schedule's plans past k), with the target's own greedy output."""
    target, draft = models
    cost = jaxspec.CostModel.from_coefficients(draft_fixed=5e-2, draft_per_token=0.0, target_fixed=5e-3,
                                               target_per_token=1e-5, target_per_context_token=0.0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 3, 12)]
    want = jaxspec.generate(target, prompts, max_new_tokens=24).tokens
    suffix = jaxspec.SuffixDrafter(max_depth=12, corpus_tokens=4096)
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter([suffix, draft]),
                                         spec=jaxspec.SpecConfig(k=4, policy="goodput", cost_model=cost))
    assert decoder.generate(prompts, max_new_tokens=24, batch_size=4).tokens == want
    again = decoder.generate(prompts, max_new_tokens=24, batch_size=4)
    assert again.tokens == want
    free_steps = sum(steps for plan, steps in again.stats.extra["segments"] if plan > 4)
    assert free_steps >= again.stats.steps // 2 and again.stats.accepted_tokens > 40, again.stats.extra


def test_bad_members_are_refused(models):
    target, draft = models
    with pytest.raises(ValueError, match="at least two drafters, got 1"):
        jaxspec.HybridDrafter([jaxspec.SuffixDrafter()])
    with pytest.raises(ValueError, match="first member must be n-gram or suffix lookup .* got ModelDrafter"):
        jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter([draft, jaxspec.SuffixDrafter()]))
    with pytest.raises(ValueError, match="cannot be placed on a MeshConfig yet"):
        jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter([jaxspec.SuffixDrafter(), draft]),
                                   mesh=jaxspec.MeshConfig(target_tp=2, draft_tp=0))
    with pytest.raises(ValueError, match="HybridDrafter members must be .* got ChainDrafter"):
        jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter(
            [jaxspec.SuffixDrafter(), jaxspec.SpeculativeDecoder(draft, jaxspec.NgramDrafter())]))


@pytest.mark.slow   # 4000 rows, like the suffix drafter's own chi-square
def test_hybrid_sampling_follows_the_targets_distribution():
    """A corpus and a sampling draft model, rows choosing between them: the first four tokens
    follow the target's exact distribution."""
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models
    target, draft, _ = vocab6_models()
    prompt, sampling, rows = VOCAB6_PROMPT + [1, 4, 2, 5, 1], SamplingConfig(temperature=0.7, top_k=3), 4000
    suffix = jaxspec.SuffixDrafter(max_depth=4, corpus_tokens=64, min_token_prob=0.3)
    suffix.remember([prompt + [3, 0, 2, 4], prompt + [3, 0, 5], prompt + [2, 2]])
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.HybridDrafter([suffix, draft]),
                                         spec=jaxspec.SpecConfig(k=2), sampling=sampling)
    result = decoder.generate([prompt] * rows, max_new_tokens=4, seed=43)
    assert_matches_distribution(result.tokens, exact_joint(target, prompt, 4, sampling), rows)
    assert result.stats.accepted_tokens > 0


def test_cli_suffix_plus_a_draft_model_is_the_hybrid_and_matches_plain_decoding(tiny_path, tmp_path):
    """`jaxspec generate --draft suffix+PATH` (the target as its own draft model, so every draft
    it makes is accepted): the same tokens as --draft none, and most tokens come from drafts."""
    from test_cli import generate_args, read_output, token_jobs, write_jobs

    from jaxspec.cli import main as cli

    jobs = write_jobs(tmp_path / "in.jsonl", token_jobs(4, seed=5, low=6, high=12))
    common = ("--k", "4", "--max-new-tokens", "12", "--batch-size", "2")
    hybrid, plain = tmp_path / "hybrid.jsonl", tmp_path / "plain.jsonl"
    assert cli.main(generate_args(tiny_path, jobs, hybrid, "--draft", f"suffix+{tiny_path}", *common)) == 0
    assert cli.main(generate_args(tiny_path, jobs, plain, "--draft", "none", *common)) == 0
    got, want = read_output(hybrid), read_output(plain)
    assert {i: r["tokens"] for i, r in got.items()} == {i: r["tokens"] for i, r in want.items()}
    assert sum(r["stats"]["accepted"] for r in got.values()) >= 0.6 * 4 * 11   # 12 tokens: 11 after the first
