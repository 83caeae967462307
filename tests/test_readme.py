"""The README's examples run as written (issue 61).

Its ```python blocks build on each other (the second drafts with, and trains on, the first one's
SmolLM2), so they run as the README reads: in order, in one namespace, in a fresh working directory
(they write cost.json, my-head/, ...). The first block (SmolLM2-135M only, about a minute on 2
cores) runs in the default suite; both, the second needing the Qwen pair of `make models-qwen` and
training for a few steps, in the slow step. Shell blocks do not run; the `jaxspec` commands in them
are parsed by the command's own parser. docs/stats.md is checked against the statistics here too.
"""

import re
import shlex
from pathlib import Path

import pytest

import jaxspec
from jaxspec.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", (REPO / "README.md").read_text(), flags=re.M | re.S)


def run_blocks(count: int, folder: Path, monkeypatch) -> dict:
    """Executes the README's first `count` python blocks in `folder`; returns their namespace."""
    monkeypatch.chdir(folder)
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks("python")[:count]):
        exec(compile(block, f"README.md, python block {i + 1}", "exec"), namespace)
    return namespace


def commands() -> list[list[str]]:
    """The `jaxspec ...` commands of the README's shell blocks, as argument lists (after `jaxspec`)."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0])
            if words and words[0].endswith("bin/jaxspec"):
                found.append(words[1:])
    return found


def test_the_first_python_block_runs_and_its_speculative_output_is_the_models_own(tmp_path, monkeypatch):
    ns = run_blocks(1, tmp_path, monkeypatch)
    prompt = "one two three four five one two three four five one two"   # the block's n-gram example, greedy
    assert ns["out"].tokens == jaxspec.generate(ns["model"], [prompt], max_new_tokens=16).tokens


def test_the_readmes_commands_parse():
    found = commands()
    assert [words[0] for words in found] == ["generate"]
    args = build_parser().parse_args(found[0])
    assert (args.k, args.max_new_tokens, args.batch_size) == (4, 64, 8)


@pytest.mark.slow   # the Qwen pair (make models-qwen) and a few training steps: several minutes
def test_every_python_block_runs_and_the_draft_models_output_is_the_targets_own(tmp_path, monkeypatch):
    ns = run_blocks(len(blocks("python")), tmp_path, monkeypatch)
    assert ns["out"].tokens == jaxspec.generate(ns["target"], ns["prompts"], max_new_tokens=32).tokens
    assert (tmp_path / "cost.json").exists() and (tmp_path / "my-draft").is_dir()
    # The shell example's models are the ones example_model names.
    args = build_parser().parse_args(commands()[0])
    assert [str(REPO / path) for path in (args.target, args.draft)] == [
        jaxspec.example_model("qwen2.5-coder-1.5b"), jaxspec.example_model("qwen2.5-coder-0.5b")]


def test_docs_stats_explains_every_field_and_its_relations_hold(tiny_model):
    """docs/stats.md names every GenerationStats field and extra key, and the relations it states
    hold: n-gram verifies k slots per row-step whatever it proposed, counts one draft forward (the
    prefill), and 3 prompts run in 4 slots; a draft model proposes and runs k per step."""
    import dataclasses

    doc = (REPO / "docs" / "stats.md").read_text()
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3, [12, 13]]
    ngram = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(max_ngram=2), spec=jaxspec.SpecConfig(k=4))
    draft = jaxspec.Model.random(tiny_model.config.replace(num_layers=1), seed=1)
    model = jaxspec.SpeculativeDecoder(tiny_model, draft, spec=jaxspec.SpecConfig(k=3))
    for decoder, k in ((ngram, 4), (model, 3)):
        s = decoder.generate(prompts, max_new_tokens=12).stats
        missing = [name for name in [f.name for f in dataclasses.fields(s)] + list(s.extra) if f"`{name}`" not in doc]
        assert not missing, missing
        row_steps = sum(s.extra["per_request_steps"])
        assert s.extra["slots"] == 4 and s.extra["k_trace"] == [k] * s.steps and s.target_forwards == s.steps + 1
        assert s.verified_tokens == k * row_steps and s.mean_draft_length == k
        assert s.mean_accepted_length == pytest.approx((s.new_tokens - len(prompts)) / row_steps)
        assert s.extra["masked"] == round(1 - row_steps / s.extra["slot_steps"], 4)
        if decoder is ngram:
            assert s.draft_forwards == 1 and s.drafted_tokens < s.verified_tokens
        else:
            assert s.draft_forwards == k * s.steps + 1 and s.drafted_tokens == k * row_steps
