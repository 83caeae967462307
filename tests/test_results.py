"""What a call reports: its compilation apart from its decoding, and texts that end before eos."""

import time

import jax
import numpy as np
import pytest
from conftest import CompileCounter, random_prompts

import jaxspec
from jaxspec.engine import timing

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_overlapping_and_nested_compile_spans_count_once():
    start = time.time()
    # (start, end) offsets: two overlapping spans (0.03 s in all), one nested in another (0.01 s),
    # one that began before `start` (clipped to 0.001 s, inside the first), and a span of another event.
    for lo, hi in [(0.0, 0.02), (0.01, 0.03), (0.05, 0.06), (0.052, 0.055), (-5.0, 0.001)]:
        jax.monitoring.record_event_time_span(COMPILE_EVENT, start + lo, start + hi)
    jax.monitoring.record_event_time_span("/jax/another/event", start, start + 0.09)
    time.sleep(0.1)
    before = time.time()
    compiled, other = timing.split_compile(start)
    assert compiled == pytest.approx(0.04, abs=1e-6)   # time.time() near 2e9 keeps ~1e-7 s
    assert before - start - compiled <= other <= time.time() - start - compiled


def _timed(call):
    """(the call's stats, its wall seconds measured here, JAX's backend compile seconds during it)."""
    backend = []

    def listener(event, seconds, **_):
        if event == COMPILE_EVENT:
            backend.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        start = time.time()
        stats = call().stats
        return stats, time.time() - start, sum(backend)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_a_first_call_reports_compilation_apart_and_a_warm_call_none(tiny_model):
    jaxspec.clear_caches()   # the first call compiles (or loads from the session's persistent cache)
    rng = np.random.default_rng(0)
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(max_ngram=2), spec=jaxspec.SpecConfig(k=3))
    first, wall, backend = _timed(lambda: decoder.generate(random_prompts(rng, (5, 9, 3), 256), max_new_tokens=12))
    assert backend > 0
    assert backend <= first.compile_seconds   # it covers tracing and lowering too
    # The two parts are the call's wall time, less preparing the inputs and reading the result.
    assert 0.9 * wall <= first.seconds + first.compile_seconds <= wall
    assert first.seconds > 0 and first.tokens_per_second == pytest.approx(first.new_tokens / first.seconds)
    warm, wall, backend = _timed(lambda: decoder.generate(random_prompts(rng, (6, 2, 8), 256), max_new_tokens=12))
    assert backend == 0 and warm.compile_seconds == 0.0
    assert 0 < warm.seconds <= wall and warm.tokens_per_second == pytest.approx(warm.new_tokens / warm.seconds)


def test_warm_up_compiles_what_a_call_of_the_same_shapes_needs(tiny_model):
    jaxspec.clear_caches()
    rng = np.random.default_rng(1)
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(max_ngram=2), spec=jaxspec.SpecConfig(k=2))
    # Three prompts in two slots: the third refills a finished row.
    compiled = decoder.warm_up(random_prompts(rng, (4, 7, 5), 256), max_new_tokens=10, batch_size=2)
    assert compiled > 0
    with CompileCounter() as counter:
        stats = decoder.generate(random_prompts(rng, (6, 3, 8), 256), max_new_tokens=10, batch_size=2).stats
    assert counter.count == 0 and stats.compile_seconds == 0.0


def test_texts_end_before_the_stop_token_and_the_tokens_keep_it(smollm2):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    free = jaxspec.generate(smollm2, prompts, max_new_tokens=8).tokens
    eos = free[0][3]   # a token the first row emits mid-way
    stopped = jaxspec.generate(smollm2, prompts, max_new_tokens=8, eos_token_id=eos)
    for row, tokens, text in zip(free, stopped.tokens, stopped.texts, strict=True):
        end = row.index(eos) if eos in row else len(row)
        assert tokens == row[:end + 1]
        assert text == smollm2.tokenizer.decode(row[:end])
    assert stopped.tokens[0][-1] == eos and stopped.texts[0] != smollm2.tokenizer.decode(stopped.tokens[0])
