"""`jaxspec generate` before and around the work: every argument checked before a model loads
(the --draft form first, with the valid forms in the message; every path), the suffix forms behind
one switch; one line per stage on stderr; the summary's load / compile / decode split and the
requests' latency percentiles."""

import subprocess
import sys
import types

import pytest
from test_cli import generate_args, token_jobs, write_jobs

import jaxspec
from jaxspec.cli import checks, report
from jaxspec.cli import main as cli

CLI = [sys.executable, "-m", "jaxspec.cli"]
FORMS = ("PATH", "preset:NAME", "HEAD_DIR", "ngram", "none")


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the check must come first."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(cli, "load_model", load)
    monkeypatch.setattr(jaxspec, "load", load)


@pytest.fixture
def without_suffix(monkeypatch):
    monkeypatch.delattr(jaxspec, "SuffixDrafter", raising=False)
    monkeypatch.delattr(jaxspec, "HybridDrafter", raising=False)


def test_a_mistyped_draft_exits_2_naming_the_valid_forms_before_anything_else(tmp_path):
    """Checked first: the target and the prompts do not even exist here."""
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(CLI + generate_args("/nonexistent/model", str(tmp_path / "absent.jsonl"), out,
                                              "--draft", "ngrams"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("jaxspec: error: --draft ngrams: ") and "did you mean 'ngram'?" in proc.stderr
    assert all(form in proc.stderr for form in (*FORMS, "suffix")), proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--draft", "NODIR/draft.gguf"], "--draft NODIR/draft.gguf: no such file or folder, and not a keyword"),
    (["--draft", "preset:tinyy"], "--draft preset:tinyy: unknown preset 'tinyy' (did you mean preset:tiny?)"),
    (["--draft", "suffix"], "--draft suffix: suffix decoding is not available in this version (no "
                            "jaxspec.SuffixDrafter); valid forms: PATH"),
    (["--draft", "suffix+preset:tiny"], "suffix decoding with a draft model is not available in this version"),
    (["--target", "NODIR/model.gguf"], "--target NODIR/model.gguf: no such file or folder"),
    (["--target", "preset:nope"], "--target preset:nope: unknown preset 'nope'"),
    (["--policy", "goodput", "--cost-model", "NODIR/cost.json"], "NODIR/cost.json"),
    (["--prompts", "NODIR/in.jsonl"], "NODIR/in.jsonl"),
])
def test_every_argument_is_checked_before_a_model_loads(tiny_path, tmp_path, capsys, no_loading, without_suffix,
                                                        args, message):
    args = [a.replace("NODIR", str(tmp_path / "nowhere")) for a in args]
    message = message.replace("NODIR", str(tmp_path / "nowhere"))
    prompts = write_jobs(tmp_path / "in.jsonl", token_jobs(2))
    assert cli.main(generate_args(tiny_path, prompts, tmp_path / "out.jsonl", *args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("jaxspec: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--draft", "none", "--policy", "goodput", "--cost-model", "x.json"], "needs a drafter"),
    (["--policy", "goodput"], "needs --cost-model"),
    (["--extra", "2"], "only applies with --selection tetris"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--k", "-1"], "k must be an int >= 0"),
    (["--tree", "3"], "--tree must be DEPTH,WIDTH"),
    (["--tree", "9,4"], "more than MAX_TREE_COLUMNS=64"),
])
def test_bad_settings_fail_before_loading(tmp_path, capsys, args, message):
    prompts = write_jobs(tmp_path / "in.jsonl", token_jobs(2))
    assert cli.main(generate_args("/nonexistent/model", prompts, tmp_path / "out.jsonl", *args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_the_suffix_forms_follow_the_library(monkeypatch, tiny_model):
    """One switch (`checks.suffix_drafters`): once jaxspec has SuffixDrafter (and HybridDrafter),
    --draft suffix (and suffix+MODEL) parse and build them."""
    fake = types.SimpleNamespace
    monkeypatch.setattr(jaxspec, "SuffixDrafter", lambda: fake(kind="suffix"), raising=False)
    monkeypatch.delattr(jaxspec, "HybridDrafter", raising=False)
    form = checks.parse_draft("suffix")
    assert (form.model, form.lookup) == (None, "suffix") and checks.make_drafter(form, None).kind == "suffix"
    assert "suffix" in checks.valid_forms() and "suffix+PATH" not in checks.valid_forms()
    with pytest.raises(ValueError, match="no jaxspec.HybridDrafter"):
        checks.parse_draft("suffix+preset:tiny")
    monkeypatch.setattr(jaxspec, "HybridDrafter", lambda parts: fake(parts=parts), raising=False)
    form = checks.parse_draft("suffix+preset:tiny")
    assert (form.model, form.lookup) == ("preset:tiny", "suffix")
    hybrid = checks.make_drafter(form, tiny_model)
    assert [p.kind if hasattr(p, "kind") else p for p in hybrid.parts] == ["suffix", tiny_model]


def test_the_other_forms_parse(tiny_path):
    assert checks.parse_draft("ngram") == checks.DraftForm("ngram", None, "ngram")
    assert checks.parse_draft("none").plain
    assert checks.parse_draft(tiny_path) == checks.DraftForm(tiny_path, tiny_path, None)
    assert checks.parse_draft("preset:tiny").model == "preset:tiny"


def test_stage_lines_and_the_summary(tiny_path, tmp_path, capsys):
    prompts = write_jobs(tmp_path / "in.jsonl", token_jobs(5, seed=5))
    assert cli.main(generate_args(tiny_path, prompts, tmp_path / "out.jsonl", "--draft", tiny_path, "--k", "2",
                                  "--max-new-tokens", "6", "--batch-size", "2")) == 0
    captured = capsys.readouterr()
    stages = [line for line in captured.err.splitlines() if line.startswith("jaxspec: [")]
    assert [line.split("] ", 1)[1].split(" ")[0] for line in stages] == ["loading", "loading", "decoding", "done:"]
    assert f"loading target {tiny_path}" in stages[0] and f"loading draft {tiny_path}" in stages[1]
    seconds = [float(line.split("[")[1].split(" s]")[0]) for line in stages]
    assert seconds == sorted(seconds)
    header, _, row = captured.out.strip().splitlines()[-3:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in (header, row)]
    summary = dict(zip(*cells))
    assert {"load_s", "compile_s", "decode_s", "tokens/s", "latency_p50_s", "latency_p95_s"} <= set(summary)
    assert "setup_s" not in summary and "process" not in summary and "compile+decode_s" not in summary
    assert int(summary["requests"]) == 5 and int(summary["new_tokens"]) == 30
    p50, p95, compiled, decoded = (float(summary[k]) for k in ("latency_p50_s", "latency_p95_s", "compile_s",
                                                               "decode_s"))
    assert 0 < p50 <= p95 <= (compiled + decoded) * 1.001 + 1e-3   # the table rounds to 3 digits


def test_latency_percentiles():
    assert report.latency([4.0, 1.0, 3.0, 2.0, 100.0]) == {"latency_p50_s": 3.0, "latency_p95_s": pytest.approx(80.8)}
    assert report.latency([]) == {}


def test_the_summary_splits_compilation_from_decoding():
    stats = jaxspec.GenerationStats(new_tokens=40, acceptance_rate=0.5, mean_accepted_length=2.0, compile_seconds=8.0)
    row = report.summary(stats, load_s=3.0, run_s=10.0, finished=[10.0])
    assert (row["compile_s"], row["decode_s"], row["tokens/s"]) == (8.0, 2.0, 20.0) and "compile+decode_s" not in row
    unsplit = types.SimpleNamespace(**{k: v for k, v in vars(stats).items() if k != "compile_seconds"})
    row = report.summary(unsplit, load_s=3.0, run_s=10.0, finished=[10.0])   # stats without compile_seconds
    assert row["compile+decode_s"] == 10.0 and row["tokens/s"] == 4.0 and "compile_s" not in row
