"""The command line: `generate` end to end (same tokens as the Python API), resuming after a kill,
torn-line repair, bad input, `--help`; `profile` and `bench` in-process. Early argument checks,
stage lines and the summary: test_cli_checks; the job's settings record: test_cli_settings."""

import json
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.cli import jobs
from jaxspec.cli import main as cli
from jaxspec.engine import kernels
from jaxspec.policy.cost import CostModel

CLI = [sys.executable, "-m", "jaxspec.cli"]


def write_jobs(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def read_output(path) -> dict:
    """Output records by id; fails on a repeated id."""
    records = [json.loads(line) for line in open(path)]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "an id was written twice"
    return by_id


def token_jobs(n: int, seed: int = 0, low: int = 3, high: int = 20) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt": rng.integers(0, 256, int(rng.integers(low, high))).tolist()} for i in range(n)]


def generate_args(target, prompts, output, *extra) -> list[str]:
    return ["generate", "--target", target, "--prompts", prompts, "--output", str(output), "--no-progress", *extra]


def test_generate_subprocess_matches_python_api(tiny_path, tmp_path):
    records = token_jobs(10)
    records[3]["max_new_tokens"] = 5
    records[7]["id"] = 7        # ids may be ints; they are copied as they are
    prompts = write_jobs(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(CLI + generate_args(tiny_path, prompts, out, "--draft", "ngram", "--k", "3",
                                              "--max-new-tokens", "16", "--batch-size", "4"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "new_tokens" in proc.stdout and "acceptance" in proc.stdout   # the summary table

    model = jaxspec.load(tiny_path)
    ids = [r["prompt"] for r in records]
    budgets = [r.get("max_new_tokens", 16) for r in records]
    decoder = jaxspec.SpeculativeDecoder(model, jaxspec.NgramDrafter(max_ngram=3), spec=jaxspec.SpecConfig(k=3))
    expected = decoder.generate(ids, max_new_tokens=budgets, batch_size=4)
    assert expected.tokens == jaxspec.generate(model, ids, max_new_tokens=budgets).tokens   # greedy: lossless
    got = read_output(out)
    assert sorted(got, key=str) == sorted((r["id"] for r in records), key=str)
    for record, tokens, budget in zip(records, expected.tokens, budgets):
        line = got[record["id"]]
        assert line["tokens"] == tokens and len(tokens) == budget and line["text"] is None
        stats = line["stats"]
        assert stats["new_tokens"] == budget and stats["steps"] >= 1 and 0 <= stats["accepted"] <= stats["drafted"]
        assert stats["finish"] == "length"


@pytest.mark.parametrize("draft_args", [["--draft", "none"],
                                        ["--draft", "ngram", "--k", "2", "--selection", "tetris", "--extra", "1"],
                                        ["--draft", "SELF", "--k", "2", "--target-tp", "2", "--draft-tp", "1",
                                         "--pipeline"],
                                        ["--draft", "SELF", "--k", "2", "--draft-tp", "1", "--pipeline",
                                         "--policy", "goodput", "--cost-model", "COST"],
                                        ["--draft", "SELF", "--k", "3", "--tree", "2,2"]])
def test_generate_in_process_is_lossless(tiny_path, tiny_model, tmp_path, draft_args, capsys):
    """Plain decoding (--draft none), TETRIS, and a draft model on its own device slice, pipelined,
    with a fixed k and under the goodput policy, all give the greedy tokens."""
    records = token_jobs(6, seed=1)
    prompts = write_jobs(tmp_path / "in.jsonl", records)
    cost = tmp_path / "cost.json"
    jaxspec.CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=0.0, target_fixed=5e-3,
                                        target_per_token=1e-4).save(cost)
    draft_args = [{"SELF": tiny_path, "COST": str(cost)}.get(a, a) for a in draft_args]
    out = tmp_path / "out.jsonl"
    assert cli.main(generate_args(tiny_path, prompts, out, "--max-new-tokens", "8", "--batch-size", "2",
                                  *draft_args)) == 0
    expected = jaxspec.generate(tiny_model, [r["prompt"] for r in records], max_new_tokens=8).tokens
    got = read_output(out)
    assert [got[r["id"]]["tokens"] for r in records] == expected
    if draft_args[1] == "none":
        assert all(line["stats"]["drafted"] == 0 for line in got.values())


@pytest.mark.slow
def test_generate_smollm2_strings_match_python_api(smollm2, smollm2_path, tmp_path):
    texts = ["The cat sat on the mat. The cat sat on the", "1, 2, 3, 4, 5, 6,", "Repeat: red green blue red green",
             "Reply with one word: yes or no. Is the sky blue?"]
    prompts = write_jobs(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": t} for i, t in enumerate(texts)])
    out = tmp_path / "out.jsonl"
    assert cli.main(generate_args(smollm2_path, prompts, out, "--draft", "ngram", "--k", "3", "--chat",
                                  "--max-new-tokens", "8")) == 0
    tok = smollm2.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    decoder = jaxspec.SpeculativeDecoder(smollm2, jaxspec.NgramDrafter(max_ngram=3), spec=jaxspec.SpecConfig(k=3))
    expected = decoder.generate(chats, max_new_tokens=8, eos_token_id=tok.eos_token_id)
    got = read_output(out)
    assert [got[f"p{i}"]["text"] for i in range(4)] == expected.texts
    assert [got[f"p{i}"]["tokens"] for i in range(4)] == expected.tokens
    short = got["p3"]   # a one-word answer: its text ends before the stop token its tokens end with
    assert short["tokens"][-1] == tok.eos_token_id and short["text"] == tok.decode(short["tokens"][:-1])


def killed_after(lines: int) -> list[str]:
    """The CLI in a process that SIGKILLs itself right after its `lines`-th result line: a kill
    mid-run at a point that does not depend on how fast the machine is."""
    return [sys.executable, "-c", f"""
import os, signal, sys
from jaxspec.cli import main as cli
from jaxspec.cli import jobs
write = jobs.ResultWriter.write
def write_then_die(self, record, written=[]):
    write(self, record)
    written.append(record)
    if len(written) == {lines}:
        os.kill(os.getpid(), signal.SIGKILL)
jobs.ResultWriter.write = write_then_die
sys.exit(cli.main(sys.argv[1:]))
"""]


def test_killed_run_resumes_with_every_id_exactly_once(tiny_path, tiny_model, tmp_path):
    records = token_jobs(24, seed=2)
    prompts = write_jobs(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    args = generate_args(tiny_path, prompts, out, "--draft", "ngram", "--k", "2", "--max-new-tokens", "16",
                         "--batch-size", "2")
    killed = subprocess.run(killed_after(3) + args, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    finished = out.read_bytes().count(b"\n")
    assert finished == 3
    # What a kill during a write leaves behind: a cut-off line.
    with open(out, "a") as f:
        f.write('{"id": "r99", "text": null, "tokens": [1, 2')
    rerun = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "torn line" in rerun.stderr and "Traceback" not in rerun.stderr
    skipped = int(rerun.stdout.split("skipped ")[1].split()[0])
    assert skipped == finished
    # The API with the same settings (all rows in one jaxspec.generate call can flip a near-tie of
    # the random model's logits: its float sums run in another order than at batch 2).
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(max_ngram=3), spec=jaxspec.SpecConfig(k=2))
    expected = decoder.generate([r["prompt"] for r in records], max_new_tokens=16, batch_size=2).tokens
    got = read_output(out)   # also checks no id is there twice
    assert [got[r["id"]]["tokens"] for r in records] == expected


def test_torn_last_line_is_cut_and_a_whole_unterminated_line_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    good = '{"id": "a", "tokens": [1]}\n{"id": 2, "tokens": [2]}\n'
    out.write_text(good + '{"id": "c", "tok')
    scan = jobs.scan_output(out)
    assert scan.done == {jobs.id_key("a"), jobs.id_key(2)} and scan.torn == '{"id": "c", "tok'
    jobs.repair_output(out, scan)
    assert out.read_text() == good
    # Invalid JSON on the last line, newline and all, is also a torn write.
    out.write_text(good + '{"id": "c"\n')
    scan = jobs.scan_output(out)
    assert scan.torn and scan.valid_bytes == len(good)
    # A whole record that only lacks its newline is kept, and completed.
    out.write_text(good + '{"id": "c"}')
    scan = jobs.scan_output(out)
    assert not scan.torn and jobs.id_key("c") in scan.done
    jobs.repair_output(out, scan)
    assert out.read_text() == good + '{"id": "c"}\n'
    assert jobs.scan_output(tmp_path / "absent.jsonl").done == frozenset()


def test_invalid_line_in_the_middle_of_the_output_is_an_error(tiny_path, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    content = '{"id": "r0", "tokens": [1]}\nnot json\n{"id": "r1", "tokens": [1]}\n'
    out.write_text(content)
    with pytest.raises(jobs.JobFileError, match=r"out.jsonl:2: invalid line"):
        jobs.scan_output(out)
    prompts = write_jobs(tmp_path / "in.jsonl", token_jobs(3))
    assert cli.main(generate_args(tiny_path, prompts, out)) == 2
    assert "out.jsonl:2: invalid line" in capsys.readouterr().err
    assert out.read_text() == content


def test_rerun_skips_finished_ids_and_says_how_many(tiny_path, tiny_model, tmp_path, capsys):
    records = token_jobs(6, seed=3)
    out = tmp_path / "out.jsonl"
    first = write_jobs(tmp_path / "first.jsonl", records[:4])
    assert cli.main(generate_args(tiny_path, first, out, "--max-new-tokens", "6", "--batch-size", "2")) == 0
    capsys.readouterr()
    everything = write_jobs(tmp_path / "all.jsonl", records)
    assert cli.main(generate_args(tiny_path, everything, out, "--max-new-tokens", "6", "--batch-size", "2")) == 0
    assert "skipped 4 of 6" in capsys.readouterr().out
    expected = jaxspec.generate(tiny_model, [r["prompt"] for r in records], max_new_tokens=6).tokens
    got = read_output(out)
    assert [got[r["id"]]["tokens"] for r in records] == expected
    before = out.read_bytes()
    assert cli.main(generate_args(tiny_path, everything, out, "--max-new-tokens", "6")) == 0
    assert "nothing to do" in capsys.readouterr().out and out.read_bytes() == before


@pytest.mark.slow
def test_resumed_sampling_run_draws_what_an_uninterrupted_one_would(tiny_path, tiny_model, tmp_path, capsys):
    """Request i of the input samples from RNG stream i, whichever run finishes it: drop some
    finished lines (as if the run had died before them) and the rerun writes the same tokens."""
    records = token_jobs(6, seed=4)
    prompts, out = write_jobs(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    flags = ["--max-new-tokens", "8", "--batch-size", "2", "--temperature", "1.0", "--seed", "5"]
    assert cli.main(generate_args(tiny_path, prompts, out, *flags)) == 0
    first = read_output(out)
    kept = [line for line in out.read_text().splitlines(keepends=True) if json.loads(line)["id"] in ("r1", "r4")]
    out.write_text("".join(kept))
    assert cli.main(generate_args(tiny_path, prompts, out, *flags)) == 0
    assert "skipped 2 of 6" in capsys.readouterr().out
    decoder = jaxspec.SpeculativeDecoder(tiny_model, jaxspec.NgramDrafter(max_ngram=3), spec=jaxspec.SpecConfig(k=4),
                                         sampling=jaxspec.SamplingConfig(temperature=1.0))
    want = decoder.generate([r["prompt"] for r in records], max_new_tokens=8, seed=5).tokens
    got = read_output(out)
    assert [got[r["id"]]["tokens"] for r in records] == [first[r["id"]]["tokens"] for r in records] == want


def _long_prompt_file(path) -> str:
    context = jaxspec.ModelConfig.preset("tiny").max_position_embeddings
    return write_jobs(path, [{"id": "ok", "prompt": [1, 2, 3]}, {"id": "long", "prompt": [5] * (context - 4)}])


BAD_INPUTS = {
    "malformed": ('{"id": "a", "prompt": [1, 2]}\n{"id": "b", "prompt": [1, \n', "in.jsonl:2: invalid JSON"),
    "missing_prompt": ('{"id": "a", "prompt": [1]}\n\n{"id": "b"}\n', "in.jsonl:3: missing field 'prompt'"),
    "missing_both": ('{"text": "hi"}\n', "in.jsonl:1: missing fields 'id', 'prompt'"),
    "not_an_object": ('[1, 2, 3]\n', "in.jsonl:1: expected a JSON object"),
    "bad_tokens": ('{"id": "a", "prompt": [1, "x"]}\n', "in.jsonl:1: \"prompt\" must be"),
    "duplicate": ('{"id": "a", "prompt": [1]}\n{"id": "b", "prompt": [2]}\n{"id": "a", "prompt": [3]}\n',
                  "in.jsonl:3: duplicate id \"a\" (first on line 1)"),
    "empty": ("\n\n", "contains no requests"),
    "string_without_tokenizer": ('{"id": "a", "prompt": "hello"}\n', "in.jsonl:1: prompt is a string but the "
                                                                     "model has no tokenizer"),
    "out_of_vocabulary": ('{"id": "a", "prompt": [1, 999]}\n', "in.jsonl:1: prompt contains token id 999"),
    "too_long": (None, "in.jsonl:2: prompt of id \"long\" has 1020 tokens; with max_new_tokens=8"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_cleanly_and_writes_nothing(tiny_path, tmp_path, capsys, case):
    content, message = BAD_INPUTS[case]
    path = tmp_path / "in.jsonl"
    prompts = _long_prompt_file(path) if content is None else str(path)
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out.jsonl"
    assert cli.main(generate_args(tiny_path, prompts, out, "--max-new-tokens", "8")) == 2
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if not line.startswith("jaxspec: ["))
    assert message in err and err.startswith("jaxspec: error: ") and err.count("\n") == 1, err   # stage lines aside
    assert not out.exists()
    # An existing output file is left exactly as it was.
    out.write_text('{"id": "zzz", "tokens": [1]}\n')
    assert cli.main(generate_args(tiny_path, prompts, out, "--max-new-tokens", "8")) == 2
    assert out.read_text() == '{"id": "zzz", "tokens": [1]}\n'


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "a", "prompt": [1]}\n{oops\n')
    out = tmp_path / "out.jsonl"
    # The input is checked before the target is even looked at.
    proc = subprocess.run(CLI + generate_args("/nonexistent/model", str(prompts), out), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("jaxspec: error: ") and "in.jsonl:2: invalid JSON" in proc.stderr
    assert not out.exists()


def test_skip_bad_lines_warns_and_runs_the_rest(tiny_path, tiny_model, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": [1, 2, 3]}\n{broken\n{"id": "b", "prompt": [4, 5]}\n')
    out = tmp_path / "out.jsonl"
    assert cli.main(generate_args(tiny_path, str(path), out, "--max-new-tokens", "4", "--skip-bad-lines")) == 0
    assert "warning: skipping" in capsys.readouterr().err
    got = read_output(out)
    expected = jaxspec.generate(tiny_model, [[1, 2, 3], [4, 5]], max_new_tokens=4).tokens
    assert [got["a"]["tokens"], got["b"]["tokens"]] == expected


@pytest.mark.parametrize("command, options", [
    ([], ["generate", "profile", "bench", "distill", "train-eagle"]),
    (["generate"], ["--target", "--draft", "--prompts", "--output", "--max-new-tokens", "--k", "--selection",
                    "--temperature", "--batch-size", "--policy", "--cost-model", "--chat", "--skip-bad-lines",
                    "resum"]),
    (["profile"], ["--target", "--draft", "--batches", "--ks", "--output"]),
    (["bench"], ["--quick", "--only", "tetris"]),
    (["distill"], ["--target", "--draft", "--init-layers", "--prompts", "--heldout", "--steps", "--loss",
                   "--checkpoint-dir", "--data-cache", "--output"]),
    (["train-eagle"], ["--target", "--data", "stdlib", "shakespeare", "--prompts", "--feature-cache",
                       "--draft-vocab-size", "--checkpoint-dir", "--heldout-items", "--output"]),
])
def test_help_of_every_command(capsys, command, options):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for option in options:
        assert option in printed, option


def test_bench_runs_the_chosen_script(capsys):
    assert cli.main(["bench", "--quick", "--only", "tetris", "--dry-run", "--", "--batches", "8"]) == 0
    printed = capsys.readouterr().out
    assert "scripts/bench_tetris.py --part tiny" in printed and printed.rstrip().endswith("--batches 8")
    assert cli.main(["bench", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("bench_speculative.py", "bench_goodput.py", "mesh_sweep.py",
                                            "bench_goodput_sliced.py"))


@pytest.mark.slow   # 12 shapes compiled: 40 s; the profiler itself is tested in test_cost
def test_profile_writes_a_loadable_cost_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEC_KERNELS", "probe")   # the kernels each program compiled with are recorded
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    out = tmp_path / "cost.json"
    assert cli.main(["profile", "--target", "preset:tiny", "--draft", "preset:tiny", "--batches", "1,4",
                     "--ks", "0,1,2", "--cache-lens", "64,128", "--passes", "2", "--free", "--output", str(out)]) == 0
    cost = CostModel.load(out)
    assert cost.target_name == "tiny" and cost.draft_name == "tiny" and cost.free.draft_name == "ngram"
    # A fit of noisy timings may put every coefficient but one at zero (nonnegative least squares),
    # but it predicts a positive time at every profiled shape.
    assert all(cost.step_seconds(b, k, c) > 0 for b in (1, 4) for k in (0, 1, 2) for c in (64, 128))
    printed = capsys.readouterr().out
    assert "target_per_token" in printed and "r2" in printed and "free (no draft model)" in printed
    fit = json.loads(out.read_text())["fit"]
    assert fit["step"]["points"] == 12
    timed = [p for p in fit["kernels"]["programs"] if p["program"] == "run_on_device"]
    assert len(timed) >= 12 and all(p["kernels"] in kernels.CANDIDATES for p in timed)


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        cli.main(["profile", "--target", "preset:tiny", "--batches", "0,2"])
    assert "expected positive integers" in capsys.readouterr().err


@pytest.mark.slow
def test_distill_saves_the_draft_the_python_api_trains(tiny_path, tiny_model, tmp_path, capsys):
    records = token_jobs(8, seed=6)
    prompts, heldout = write_jobs(tmp_path / "train.jsonl", records[:6]), write_jobs(tmp_path / "held.jsonl",
                                                                                         records[6:])
    out = tmp_path / "draft"
    assert cli.main(["distill", "--target", tiny_path, "--init-layers", "1", "--prompts", prompts, "--heldout",
                     heldout, "--steps", "4", "--batch-size", "2", "--max-new-tokens", "6", "--learning-rate",
                     "3e-3", "--output", str(out), "--no-progress"]) == 0
    assert "wrote the draft" in capsys.readouterr().out
    draft = jaxspec.load(str(out))
    want, history = jaxspec.distill(tiny_model, jaxspec.draft_from_target(tiny_model, 1), [r["prompt"] for r in
                                    records[:6]], steps=4, learning_rate=3e-3, batch_size=2, max_new_tokens=6,
                                    heldout_prompts=[r["prompt"] for r in records[6:]], progress=False)
    for got_leaf, want_leaf in zip(jax.tree.leaves(draft.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)
    saved = json.loads((out / "history.json").read_text())
    assert saved["loss"] == pytest.approx(history["loss"]) and saved["eval_step"] == [0, 4]


def test_distill_bad_arguments_are_one_line_errors(tiny_path, tmp_path, capsys):
    prompts = write_jobs(tmp_path / "train.jsonl", token_jobs(2))
    for flags, needle in ((["--steps", "0"], "--steps must be >= 1"), (["--learning-rate", "0"], "--learning-rate"),
                          (["--init-layers", "3"], "num_layers must be at most the target's 2")):
        assert cli.main(["distill", "--target", tiny_path, "--prompts", prompts, "--output", str(tmp_path / "d"),
                         "--no-progress", "--init-layers", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and not (tmp_path / "d").exists()


@pytest.mark.slow
def test_train_eagle_then_generate_with_the_head_is_lossless(tiny_path, tiny_model, tmp_path, capsys):
    """A head trained by `jaxspec train-eagle` on the target's continuations of token prompts
    loads with jaxspec.load and drafts losslessly through `jaxspec generate --draft HEAD`."""
    prompts = write_jobs(tmp_path / "train.jsonl", token_jobs(12, seed=7))
    out = tmp_path / "head"
    assert cli.main(["train-eagle", "--target", tiny_path, "--prompts", prompts, "--max-new-tokens", "12",
                     "--heldout-items", "0", "--steps", "3", "--batch-size", "4", "--seq-len", "24",
                     "--draft-vocab-size", "128", "--output", str(out), "--no-progress"]) == 0
    assert "wrote the head" in capsys.readouterr().out
    head = jaxspec.load(str(out), target=tiny_model)
    assert head.config.layer.vocab_size == 128
    assert len(json.loads((out / "history.json").read_text())["loss"]) == 3
    jobs_path = write_jobs(tmp_path / "in.jsonl", token_jobs(3, seed=8))
    assert cli.main(generate_args(tiny_path, jobs_path, tmp_path / "out.jsonl", "--draft", str(out), "--k", "3",
                                  "--max-new-tokens", "10")) == 0
    got = read_output(tmp_path / "out.jsonl")
    want = jaxspec.generate(tiny_model, [r["prompt"] for r in token_jobs(3, seed=8)], max_new_tokens=10).tokens
    assert [got[f"r{i}"]["tokens"] for i in range(3)] == want
    assert cli.main(["train-eagle", "--target", tiny_path, "--output", str(tmp_path / "h2"), "--no-progress"]) == 2
    assert "--data" in capsys.readouterr().err


def test_train_eagle_data_sources(tmp_path):
    """Folders give their .py / .txt / .md files in path order, JSONL its "text" / "prompt"
    fields, `stdlib` this Python's own library source; a bad source is a one-line ValueError."""
    from jaxspec.cli.eagle import source_texts

    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b" / "c.md").write_text("# c\n")
    (tmp_path / "b" / "d.bin").write_text("skip")
    assert source_texts(str(tmp_path)) == ["x = 1\n", "# c\n"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "one"}\n\n{"prompt": "two", "id": 3}\n')
    assert source_texts(str(rows)) == ["one", "two"]
    stdlib = source_texts("stdlib")
    assert len(stdlib) > 300 and any("def namedtuple(" in text for text in stdlib)
    for bad, needle in (("nowhere/", "no such file"), (str(tmp_path / "bad.jsonl"), "line 1")):
        if bad.endswith(".jsonl"):
            (tmp_path / "bad.jsonl").write_text('["text"]\n')
        with pytest.raises(ValueError, match=needle):
            source_texts(bad)


@pytest.mark.slow   # 11-15 s (suite time); int8 speculative decoding stays in the default suite (test_quant)
def test_generate_with_int8_weights_is_the_int8_models_greedy_output(tiny_path, tmp_path):
    records = token_jobs(4, seed=3)
    prompts = write_jobs(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    assert cli.main(generate_args(tiny_path, prompts, out, "--max-new-tokens", "8", "--batch-size", "2",
                                  "--draft", tiny_path, "--k", "2", "--quantize", "int8")) == 0
    int8 = jaxspec.load(tiny_path, quantize="int8")
    expected = jaxspec.generate(int8, [r["prompt"] for r in records], max_new_tokens=8).tokens
    got = read_output(out)
    assert [got[r["id"]]["tokens"] for r in records] == expected
    assert sum(line["stats"]["accepted"] for line in got.values()) > 0   # the int8 draft is the int8 target
