"""Every program the decoder compiles runs without the host: no branch (`conditional`) and only
loops with a trip count known at compile time (on a GPU, XLA reads a data-dependent loop's
predicate back to the host every iteration, and a branch's index likewise).

Checked on the programs themselves: a fresh process decodes in every mode with XLA's dump
switched on, and each optimized module that multiplies matrices is read.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

MODES = textwrap.dedent('''
    import jaxspec
    from jaxspec import SpecConfig
    from jaxspec.models import eagle
    from jaxspec.policy.cost import CostModel

    cfg = jaxspec.ModelConfig.preset("tiny")
    # One block each: a program's structure does not depend on the depth, its compile time does (-40%).
    target = jaxspec.Model.random(cfg.replace(num_layers=1, name="tiny-1L-target"), seed=0)
    draft = jaxspec.Model.random(cfg.replace(num_layers=1, name="tiny-1L"), seed=1)
    # drafting pays under this cost model, so the policy drafts and plain decoding runs in between
    cost = CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-4, target_fixed=5e-3,
                                       target_per_token=1e-5)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    ngram = jaxspec.NgramDrafter(max_ngram=2)
    head = jaxspec.EagleDrafter(eagle.EagleHead.init(target, seed=2))
    inner = jaxspec.SpeculativeDecoder(draft, ngram, SpecConfig(k=2))
    runs = {
        "standard": (draft, SpecConfig(k=3)),
        "tetris": (draft, SpecConfig(k=2, extra=1, selection="tetris")),
        "tree": (draft, SpecConfig(k=3, tree=(2, 2))),
        "eagle": (head, SpecConfig(k=2)),
        "ngram": (ngram, SpecConfig(k=3)),
        "suffix-tree": (jaxspec.SuffixDrafter(max_depth=4), SpecConfig(k=3, tree=(2, 2))),
        # goodput's plans: the draft model, the per-row choice, and the suffix drafter alone
        "hybrid": (jaxspec.HybridDrafter([jaxspec.SuffixDrafter(max_depth=4), draft]),
                   SpecConfig(k=3, policy="goodput", cost_model=cost, segment=2)),
        "chain": (inner, SpecConfig(k=3)),
        "pipeline": (draft, SpecConfig(k=2, pipeline=True)),
    }
    for name, (drafter, spec) in runs.items():
        jaxspec.SpeculativeDecoder(target, drafter, spec).generate(prompts, max_new_tokens=24, batch_size=2)
    jaxspec.generate(target, prompts, max_new_tokens=24)
''')


def _dump(tmp_path) -> pathlib.Path:
    dump = tmp_path / "hlo"
    # The suite's backend optimisation level carries over (`make test`: 0, which compiles these programs in
    # about 60% of the CPU time); it changes code generation, not the optimised HLO read here. The
    # device count does not: the modes run on one device, as a user's script would.
    level = " ".join(re.findall(r"--xla_backend_optimization_level=\d+", os.environ.get("XLA_FLAGS", "")))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{level} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    env.pop("JAXSPEC_TEST_XLA_CACHE", None)   # no persistent cache: a cache hit would skip the dump
    subprocess.run([sys.executable, "-c", MODES], env=env, check=True, timeout=1200,
                   cwd=pathlib.Path(__file__).parents[1])
    return dump


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, str]:
    dump = _dump(tmp_path_factory.mktemp("static"))
    texts = {path.name: path.read_text() for path in dump.glob("*after_optimizations.txt")}
    return {name: text for name, text in texts.items() if re.search(r"\bdot\(", text)}


def test_decode_programs_have_no_branch_and_only_loops_of_known_trip_count(programs):
    names = " ".join(programs)
    for expected in ("start_on_device", "run_on_device", "refill_on_device", "catch_up_on_device", "_run", "_start",
                     "_verify", "_draft"):
        assert expected in names, f"no compiled program named {expected}: {sorted(programs)}"
    for name, text in programs.items():
        assert "conditional(" not in text, f"{name} branches on device"
        for line in text.splitlines():
            if " while(" in line:
                assert '"known_trip_count"' in line, f"{name} has a loop of data-dependent length: {line[:200]}"


@pytest.mark.parametrize("segment", [1, 3])
def test_segments_across_attention_blocks_and_refills_equal_plain_decoding(segment, monkeypatch):
    """Rows that cross attention blocks (`attention.BLOCK`) inside bounded segments, rows refilled
    after others finished, a drafter that often fails (n-gram over random tokens): the tokens are
    those of plain decoding with the reference attention over the whole buffer (no live bound)."""
    import numpy as np

    import jaxspec
    from jaxspec.engine import loop
    from jaxspec.models import attention

    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"), seed=0)
    rng = np.random.default_rng(segment)
    prompts = [[int(t) for t in rng.integers(0, 8, n)] for n in (60, 41, 57, 30, 3)]
    budgets = [150, 9, 80, 17, 25]   # rows grow from one attention block into the next
    monkeypatch.setattr(attention, "ATTENTION", "plain")
    jaxspec.clear_caches()
    want = jaxspec.generate(target, prompts, max_new_tokens=budgets).tokens
    monkeypatch.setattr(attention, "ATTENTION", "blocked")
    jaxspec.clear_caches()
    bounds, run = set(), loop.run_on_device
    monkeypatch.setattr(loop, "run_on_device", lambda *args: bounds.add(args[-1].live) or run(*args))
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.NgramDrafter(max_ngram=2),
                                         spec=jaxspec.SpecConfig(k=3, segment=segment))
    got = decoder.generate(prompts, max_new_tokens=budgets, batch_size=2)
    jaxspec.clear_caches()
    assert got.tokens == want
    assert {128, 256} <= bounds    # segments read one block, then two, before the whole buffer
    extra = got.stats.extra
    assert extra["segment"] == segment
    assert sum(extra["per_request_steps"]) <= extra["slot_steps"]   # every step a row ran was in a queued segment
