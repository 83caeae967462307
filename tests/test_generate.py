"""jaxspec.generate: stopping, bucketing without recompilation, strings, and bad input."""

import numpy as np
import pytest

import jaxspec
from jaxspec.sampling import SamplingConfig


def test_rows_stop_after_eos_and_never_emit_past_it(tiny_model):
    prompts = [[i, i + 1, i + 2] for i in range(0, 80, 5)]
    free = jaxspec.generate(tiny_model, prompts, max_new_tokens=16)
    # An eos that some rows hit mid-way: the most common token after the first position.
    values, counts = np.unique([t for row in free.tokens for t in row[1:]], return_counts=True)
    eos = int(values[counts.argmax()])
    stopped = jaxspec.generate(tiny_model, prompts, max_new_tokens=16, eos_token_id=eos)
    hit = 0
    for full, cut in zip(free.tokens, stopped.tokens):
        if eos in full:
            hit += 1
            assert cut == full[:full.index(eos) + 1]
        else:
            assert cut == full
    assert 0 < hit < len(prompts)
    assert stopped.stats.new_tokens == sum(map(len, stopped.tokens))
    assert stopped.stats.per_request_new_tokens == [len(t) for t in stopped.tokens]


def test_per_prompt_token_budgets(tiny_model):
    result = jaxspec.generate(tiny_model, [[1], [2, 3], [4]], max_new_tokens=[1, 5, 3])
    assert [len(t) for t in result.tokens] == [1, 5, 3]
    full = jaxspec.generate(tiny_model, [[2, 3]], max_new_tokens=5)
    assert result.tokens[1] == full.tokens[0]


def test_no_recompilation_for_new_prompts_of_bucketed_lengths(tiny_model, compile_counter):
    rng = np.random.default_rng(0)
    first = [rng.integers(0, 256, n).tolist() for n in (3, 9, 14)]
    second = [rng.integers(0, 256, n).tolist() for n in (12, 1, 7)]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9)):
        jaxspec.generate(tiny_model, first, max_new_tokens=20, sampling=sampling, seed=1)
        with compile_counter() as counter:
            jaxspec.generate(tiny_model, second, max_new_tokens=17, sampling=sampling, seed=2, eos_token_id=5)
        assert counter.count == 0


def test_string_prompts_use_the_tokenizer(smollm2):
    text = "The capital of France is"
    ids = smollm2.tokenizer(text)["input_ids"]
    by_text = jaxspec.generate(smollm2, [text], max_new_tokens=8)
    by_ids = jaxspec.generate(smollm2, [ids], max_new_tokens=8)
    assert by_text.tokens == by_ids.tokens
    assert by_text.texts == [smollm2.tokenizer.decode(by_ids.tokens[0])]
    assert "Paris" in by_text.texts[0]


@pytest.mark.parametrize("prompts, kwargs, needle", [
    ([], {}, "prompts is empty"),
    ([[1, 2], []], {}, "prompts\\[1\\] is empty"),
    ([[1, 256]], {}, "token id 256, outside \\[0, 256\\)"),
    ([[-1]], {}, "token id -1"),
    (["hello"], {}, "no tokenizer"),
    ([[1] * 1000], dict(max_new_tokens=30), "1030 positions, more than max_position_embeddings=1024"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ([[1]], dict(max_new_tokens=2.5), "max_new_tokens"),
    ([[1]], dict(eos_token_id=999), "eos_token_id"),
    ([[1]], dict(sampling="greedy"), "SamplingConfig"),
    ("just a string", {}, "list of prompts"),
])
def test_bad_input_is_rejected_at_the_boundary(tiny_model, prompts, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        jaxspec.generate(tiny_model, prompts, **kwargs)


def test_stats_report_throughput_and_steps(tiny_model):
    result = jaxspec.generate(tiny_model, [[1, 2], [3]], max_new_tokens=9)
    s = result.stats
    assert s.new_tokens == 18 and s.steps == 8  # the first token comes from the prefill
    assert s.tokens_per_second == pytest.approx(s.new_tokens / s.seconds)


def test_request_ids_name_each_prompts_random_stream(tiny_model):
    """A request's samples depend on (seed, its id) only: alone or among others, any position."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 9, 6)]
    sampling = SamplingConfig(temperature=1.0)
    together = jaxspec.generate(tiny_model, prompts, max_new_tokens=10, sampling=sampling, seed=3,
                                request_ids=[7, 8, 9]).tokens
    alone = jaxspec.generate(tiny_model, [prompts[2], prompts[0]], max_new_tokens=10, sampling=sampling, seed=3,
                             request_ids=[9, 7]).tokens
    assert alone == [together[2], together[0]]
    default = jaxspec.generate(tiny_model, prompts, max_new_tokens=10, sampling=sampling, seed=3).tokens
    assert default != together   # the default streams are the indices 0, 1, 2
    spec = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(), sampling=sampling)
    assert spec.generate([prompts[1]], max_new_tokens=10, seed=3, request_ids=[8]).tokens == \
        spec.generate(prompts, max_new_tokens=10, seed=3, request_ids=[7, 8, 9]).tokens[1:2]
    for bad in ([1, 2], [1, 1, 2], [-1, 2, 3], [0.5, 1, 2]):
        with pytest.raises(ValueError, match="request_ids"):
            jaxspec.generate(tiny_model, prompts, max_new_tokens=4, request_ids=bad)
