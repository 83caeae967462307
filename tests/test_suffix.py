"""SuffixDrafter against a brute-force suffix counter, and decoding with it: lossless (greedy
identity and a chi-square), a corpus kept across calls, eviction oldest first."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.sampling import SamplingConfig


def walk(strings, steps, budget, min_prob):
    """The most frequent path through `strings` (continuations of one match): tokens, log count
    ratios and running products, in float32 like the drafter."""
    est, out = np.float32(1), []
    for j in range(steps):
        counts = {}
        for s in strings:
            if len(s) > j:
                counts[s[j]] = counts.get(s[j], 0) + 1
        if not counts or j >= budget:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        ratio = np.float32(counts[token]) / np.float32(len(strings))
        est = np.float32(est * ratio)
        if est < np.float32(min_prob):
            break
        out.append((token, math.log(ratio), float(est)))
        strings = [s for s in strings if len(s) > j and s[j] == token]
    return out


def own_pool(ctx, depth):
    """The 16 earlier ends matching the most of the row's last tokens (up to depth), ties: the latest."""
    def run(e):
        n = 0
        while n < min(depth, e + 1) and ctx[e - n] == ctx[-1 - n]:
            n += 1
        return n
    return sorted(range(len(ctx) - 1), key=lambda e: (run(e), e))[-16:]


def reference(ctx, docs, k, depth, min_prob, factor):
    """Every candidate's path (own context m = 1..depth, then the corpus), brute force."""
    steps, paths = max(1, min(k, depth - 1)), []
    for source in ("own", "corpus"):
        for m in range(1, depth + 1):
            budget = min(math.floor(factor * m + 1e-6), depth - m)
            if m > len(ctx):
                paths.append([])
                continue
            pattern = ctx[-m:]
            if source == "own":
                strings = [ctx[e + 1:] for e in own_pool(ctx, depth) if ctx[max(e - m + 1, 0):e + 1] == pattern]
            else:
                strings = [d[p + m:p + depth] for d in docs for p in range(len(d)) if d[p:p + m] == pattern]
            paths.append(walk(strings, steps, budget, min_prob))
    return paths


def random_rows(rng, b, slots, alphabet):
    seq = rng.integers(0, alphabet, (b, slots))
    pending = rng.integers(0, slots - 1, b)
    return seq, pending


@pytest.mark.parametrize("depth, min_prob, factor, k", [(4, 0.1, 1.0, 4), (6, 0.3, 2.0, 5), (3, 0.0, 3.0, 3)])
def test_proposals_match_a_brute_force_suffix_counter(depth, min_prob, factor, k):
    rng = np.random.default_rng(depth)
    docs = [rng.integers(0, 4, n).tolist() for n in rng.integers(1, 30, 12)]
    drafter = jaxspec.SuffixDrafter(max_depth=depth, corpus_tokens=400, min_token_prob=min_prob,
                                    max_spec_factor=factor).bind_vocab(5)
    drafter.remember(docs)
    seq, pending = random_rows(rng, 40, 48, 4)
    propose = jax.jit(lambda params, seq, pending: drafter.propose(params, (), seq, pending, k, None, SamplingConfig()))
    proposal, _ = propose(drafter.params, jnp.asarray(seq, jnp.int32), jnp.asarray(pending, jnp.int32))
    tokens, logq, num = (np.asarray(x) for x in (proposal.tokens_bk, proposal.logprob_bk, proposal.num_drafts_b))
    forecast = np.asarray(jax.jit(drafter.forecast, static_argnums=3)(
        drafter.params, jnp.asarray(seq, jnp.int32), jnp.asarray(pending, jnp.int32), k))
    drafted = 0
    for i in range(len(seq)):
        paths = reference(seq[i, :pending[i] + 1].tolist(), docs, k, depth, min_prob, factor)
        scores = [sum(p[2] for p in path) for path in paths]
        got = tokens[i, :num[i]].tolist()
        close = [p for p, s in zip(paths, scores) if s >= max(scores) - 1e-5]
        assert any([t for t, _, _ in p] == got for p in close), (i, got, paths[scores.index(max(scores))])
        path = next(p for p in close if [t for t, _, _ in p] == got)
        np.testing.assert_allclose(logq[i, :num[i]], [q for _, q, _ in path], rtol=1e-5, atol=1e-6)
        # what the goodput policy reads before it chooses: the path's running products, 0 past it
        np.testing.assert_allclose(forecast[i], [e for _, _, e in path] + [0.0] * (k - num[i]), rtol=1e-5, atol=1e-6)
        drafted += num[i]
    assert drafted > len(seq)   # the test sees real drafts
    np.testing.assert_array_equal(np.asarray(proposal.q_bkv).argmax(-1), tokens)


def test_the_corpus_keeps_the_newest_requests_and_its_index_is_sorted():
    """Oldest first out, against a list that keeps the newest requests fitting the budget (each
    takes its length plus a separator); the index sorts every position by its next depth tokens."""
    rng, depth, slots = np.random.default_rng(1), 5, 60
    drafter, kept = jaxspec.SuffixDrafter(max_depth=depth, corpus_tokens=slots), []
    for call in range(6):
        new = [rng.integers(0, 7, n).tolist() for n in rng.integers(1, 15, 3)]
        drafter.remember(new)
        kept += new
        while sum(len(r) + 1 for r in kept) > slots:
            kept.pop(0)
        text, order = np.asarray(drafter.params["text"]), np.asarray(drafter.params["order"])
        used = sum(len(r) + 1 for r in kept)
        assert text[:used].tolist() == [t for r in kept for t in r + [-1]] and (text[used:] == -1).all()
        keys = [tuple(text[p:p + depth]) for p in order]
        assert keys == sorted(keys) and sorted(order.tolist()) == list(range(slots + depth))
    drafter.forget()
    assert (np.asarray(drafter.params["text"]) == -1).all()


def test_bad_settings_are_refused_with_the_limit():
    for kwargs, message in ((dict(max_depth=0), "max_depth must be an int >= 1, got 0"),
                            (dict(corpus_tokens=0), "corpus_tokens must be an int >= 1"),
                            (dict(min_token_prob=1.0), r"min_token_prob must be in \[0, 1\), got 1.0"),
                            (dict(min_token_prob=-0.1), r"min_token_prob must be in \[0, 1\)"),
                            (dict(max_spec_factor=0), "max_spec_factor must be a number > 0")):
        with pytest.raises(ValueError, match=message):
            jaxspec.SuffixDrafter(**kwargs)
    with pytest.raises(ValueError, match="token ids >= 0"):
        jaxspec.SuffixDrafter().remember([[1, -2]])


@pytest.fixture(scope="module")
def tiny():
    return jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"), seed=0)


@pytest.mark.parametrize("spec", [dict(k=4), dict(k=3, extra=2, selection="tetris", capacity=12),
                                  dict(k=3, tree=(3, 2))], ids=["standard", "tetris", "tree"])
def test_a_second_call_drafts_from_the_first_and_both_equal_the_targets_greedy_output(tiny, spec, compile_counter):
    """Six prompts in four slots (refills); the second call repeats four of them and adds two new
    ones: the corpus holds the repeated prompts' exact continuations, so drafts are accepted. A
    grown corpus is new params of the same shapes: a third call compiles nothing."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 3, 12, 7, 4)]
    again = prompts[:4] + [rng.integers(0, 256, n).tolist() for n in (6, 10)]
    want = jaxspec.generate(tiny, prompts + again[4:], max_new_tokens=20).tokens
    drafter = jaxspec.SuffixDrafter(max_depth=12, corpus_tokens=4096)
    decoder = jaxspec.SpeculativeDecoder(tiny, drafter, spec=jaxspec.SpecConfig(**spec))
    first = decoder.generate(prompts, max_new_tokens=20, batch_size=4)
    second = decoder.generate(again, max_new_tokens=20, batch_size=4)
    assert first.tokens == want[:6]
    assert second.tokens == want[:4] + want[6:]
    repeated = sum(second.stats.extra["per_request_accepted"][:4]) / sum(second.stats.per_request_new_tokens[:4])
    assert repeated > 0.6, second.stats
    assert second.stats.mean_accepted_length > 1.5 * first.stats.mean_accepted_length
    with compile_counter() as counter:
        assert decoder.generate(again, max_new_tokens=20, batch_size=4).tokens == second.tokens
    assert counter.count == 0, counter.names


def test_requests_draft_from_those_finished_earlier_in_the_same_call(tiny):
    """Four prompts, then the same four again, in four slots: the repeats come in at refills
    after the first runs went into the corpus, so they draft their exact continuations."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, 8).tolist() for _ in range(4)] * 2
    want = jaxspec.generate(tiny, prompts[:4], max_new_tokens=24).tokens * 2
    result = jaxspec.SpeculativeDecoder(tiny, jaxspec.SuffixDrafter(max_depth=12, corpus_tokens=4096),
                                        spec=jaxspec.SpecConfig(k=4)).generate(prompts, max_new_tokens=24, batch_size=4)
    assert result.tokens == want
    accepted, emitted = result.stats.extra["per_request_accepted"], result.stats.per_request_new_tokens
    assert sum(accepted[4:]) / sum(emitted[4:]) > 0.6 > sum(accepted[:4]) / sum(emitted[:4]), accepted


@pytest.mark.slow   # 40 s per case (suite time), compiling for 4000 rows; the rule is n-gram lookup's (one-hot q)
@pytest.mark.parametrize("spec", [dict(k=2), dict(k=3, tree=(2, 2))], ids=["chain", "tree"])
def test_suffix_sampling_follows_the_targets_distribution(spec):
    """Requests drafted from a corpus (and their own repeats), with rejection sampling: the
    first four tokens (the prefill's, two drafts or a correction, the bonus; a tree: depth 2)
    follow the target's exact distribution."""
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models
    target = vocab6_models()[0]
    prompt, sampling, rows = VOCAB6_PROMPT + [1, 4, 2, 5, 1], SamplingConfig(temperature=0.7, top_k=3), 4000
    drafter = jaxspec.SuffixDrafter(max_depth=4, corpus_tokens=64, min_token_prob=0.05)
    drafter.remember([prompt + [3, 0, 2, 4], prompt + [3, 0, 5], prompt + [2, 2]])
    decoder = jaxspec.SpeculativeDecoder(target, drafter, spec=jaxspec.SpecConfig(**spec), sampling=sampling)
    result = decoder.generate([prompt] * rows, max_new_tokens=4, seed=41)
    assert_matches_distribution(result.tokens, exact_joint(target, prompt, 4, sampling), rows)
    assert result.stats.accepted_tokens > 0


def test_a_resumed_cli_job_drafts_from_the_requests_already_in_its_output(tiny_path, tmp_path):
    """`jaxspec generate --draft suffix` rebuilds the corpus from the output it resumes: requests that
    repeat finished ones are then drafted from them (a fresh job of the repeats alone has no corpus)."""
    from test_cli import generate_args, read_output, token_jobs, write_jobs

    from jaxspec.cli import main as cli

    first = token_jobs(4, seed=3, low=6, high=12)
    again = [{"id": f"again{i}", "prompt": job["prompt"]} for i, job in enumerate(first)]
    flags = ("--draft", "suffix", "--k", "4", "--max-new-tokens", "12", "--batch-size", "2")
    out, fresh = tmp_path / "out.jsonl", tmp_path / "fresh.jsonl"
    assert cli.main(generate_args(tiny_path, write_jobs(tmp_path / "a.jsonl", first), out, *flags)) == 0
    assert cli.main(generate_args(tiny_path, write_jobs(tmp_path / "ab.jsonl", first + again), out, *flags)) == 0
    assert cli.main(generate_args(tiny_path, write_jobs(tmp_path / "b.jsonl", again), fresh, *flags)) == 0
    resumed, alone = read_output(out), read_output(fresh)
    for i, job in enumerate(first):
        assert resumed[f"again{i}"]["tokens"] == alone[f"again{i}"]["tokens"] == resumed[job["id"]]["tokens"]

    def accepted(records):
        return sum(records[f"again{i}"]["stats"]["accepted"] for i in range(len(first)))

    assert accepted(resumed) >= 0.6 * 4 * 11 > accepted(alone)   # 12 tokens a request: 11 after the first
