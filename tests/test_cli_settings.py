"""A job remembers its settings (`jaxspec.cli.settings`): a rerun with others is refused before
anything loads, naming each difference, and leaves the output byte for byte; `--allow-mixed-settings`
appends and records where the other settings start; `jaxspec merge` refuses parts written with
other settings; models are known by content, not by path."""

import json
import shutil
import subprocess
import sys

import pytest
from test_cli import generate_args, read_output, token_jobs, write_jobs

from jaxspec.cli import main as cli
from jaxspec.cli import multihost
from jaxspec.cli import settings as settings_lib

CLI = [sys.executable, "-m", "jaxspec.cli"]
FLAGS = ("--draft", "ngram", "--k", "2", "--max-new-tokens", "6", "--batch-size", "2")


def no_loading(monkeypatch):
    """Makes any model load fail the test: what follows must be decided before loading."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(cli, "load_model", load)


@pytest.fixture(scope="module")
def finished_job(tiny_path, tmp_path_factory):
    """A finished 4-request job: (input, output, the output's bytes, its record's bytes)."""
    folder = tmp_path_factory.mktemp("job")
    prompts, out = write_jobs(folder / "in.jsonl", token_jobs(4, seed=9)), folder / "out.jsonl"
    assert cli.main(generate_args(tiny_path, prompts, out, *FLAGS)) == 0
    return prompts, out, out.read_bytes(), settings_lib.sidecar(out).read_bytes()


def test_the_record_holds_the_settings_that_change_tokens(finished_job, tiny_path):
    _, out, _, record = finished_job
    saved = json.loads(record)
    assert saved["format"] == settings_lib.FORMAT and saved["from_line"] == 1 and saved["mixed"] == []
    s = saved["settings"]
    assert (s["draft"], s["k"], s["max_new_tokens"], s["temperature"], s["seed"], s["chat"]) == ("ngram", 2, 6, 0.0,
                                                                                                0, False)
    assert s["target"]["content"] == settings_lib.fingerprint(tiny_path)["content"]
    assert "batch_size" not in s   # the batch does not change a request's tokens
    assert len(read_output(out)) == 4   # the output itself is still one result per line


@pytest.mark.parametrize("changed, named", [
    (["--temperature", "0.7"], ["temperature: 0.0 in the job, 0.7 now"]),
    (["--max-new-tokens", "9", "--k", "3", "--seed", "1"],
     ["max_new_tokens: 6 in the job, 9 now", "k: 2 in the job, 3 now", "seed: 0 in the job, 1 now"]),
    (["--draft", "none"], ["draft: \"ngram\" in the job, \"none\" now", "k: 2 in the job, 0 now"]),
    (["--draft", "preset:tiny", "--dtype", "bfloat16"],
     ["draft: \"ngram\" in the job, \"preset:tiny\" now", "dtype: \"float32\" in the job, \"bfloat16\" now"]),
])
def test_a_rerun_with_other_settings_is_refused_and_the_files_unchanged(finished_job, tiny_path, monkeypatch,
                                                                         capsys, changed, named):
    prompts, out, data, record = finished_job
    no_loading(monkeypatch)
    assert cli.main(generate_args(tiny_path, prompts, out, *FLAGS, *changed)) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxspec: error: ") and err.count("\n") == 1, err
    for difference in named:
        assert difference in err, (difference, err)
    assert err.count(" in the job, ") == len(named)   # nothing that did not change is named
    assert out.read_bytes() == data and settings_lib.sidecar(out).read_bytes() == record


def test_the_same_settings_with_another_batch_or_a_moved_model_are_accepted(finished_job, tiny_path, tmp_path,
                                                                            monkeypatch, capsys):
    prompts, out, data, record = finished_job
    moved = tmp_path / "moved"
    shutil.copytree(tiny_path, moved)
    no_loading(monkeypatch)   # every request is done: nothing loads
    assert cli.main(generate_args(str(moved), prompts, out, *FLAGS, "--batch-size", "3")) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert out.read_bytes() == data and settings_lib.sidecar(out).read_bytes() == record


def test_a_refused_rerun_in_a_subprocess_exits_2(finished_job, tiny_path):
    prompts, out, data, _ = finished_job
    proc = subprocess.run(CLI + generate_args(tiny_path, prompts, out, *FLAGS, "--temperature", "0.7"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "temperature: 0.0 in the job, 0.7 now" in proc.stderr and "--allow-mixed-settings" in proc.stderr
    assert out.read_bytes() == data


def test_allow_mixed_settings_appends_and_records_where_they_start(finished_job, tiny_path, tmp_path, capsys):
    prompts, out, data, _ = finished_job
    mixed_out = tmp_path / "out.jsonl"
    mixed_out.write_bytes(data)
    shutil.copy(settings_lib.sidecar(out), settings_lib.sidecar(mixed_out))
    more = write_jobs(tmp_path / "more.jsonl", token_jobs(6, seed=9))   # the same 4 requests and 2 more
    assert cli.main(generate_args(tiny_path, more, mixed_out, *FLAGS, "--max-new-tokens", "3",
                                  "--allow-mixed-settings")) == 0
    assert "appending to" in capsys.readouterr().err
    assert mixed_out.read_bytes().startswith(data)
    got = read_output(mixed_out)
    assert [len(got[f"r{i}"]["tokens"]) for i in range(6)] == [6, 6, 6, 6, 3, 3]
    saved = json.loads(settings_lib.sidecar(mixed_out).read_text())
    assert saved["settings"]["max_new_tokens"] == 6 and saved["from_line"] == 1
    assert [(m["settings"]["max_new_tokens"], m["from_line"]) for m in saved["mixed"]] == [(3, 5)]


def test_an_output_without_a_record_is_not_refused(tiny_path, tmp_path, monkeypatch, capsys):
    """A file from a jaxspec before records: a warning, then the run goes on (here: nothing to do)."""
    prompts, out = write_jobs(tmp_path / "in.jsonl", [{"id": "a", "prompt": [1, 2]}]), tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "tokens": [1]}\n')
    no_loading(monkeypatch)
    assert cli.main(generate_args(tiny_path, prompts, out, "--temperature", "0.5")) == 0
    assert "no settings record" in capsys.readouterr().err
    assert out.read_text() == '{"id": "a", "tokens": [1]}\n'


def test_a_stale_record_of_an_empty_output_is_ignored(tmp_path):
    out = tmp_path / "out.jsonl"
    settings_lib.record(out, {"temperature": 0.0}, "in.jsonl")
    out.write_bytes(b"")   # a run that recorded its settings, then stopped before its first line
    settings_lib.check([out], {"temperature": 1.0}, allow_mixed=False, warn=print)


def test_models_are_known_by_their_content(tmp_path):
    """The first and last MiB and the size count, the path does not."""
    data = bytearray(b"\x01" * (3 << 20))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(data)
    b.write_bytes(data)
    same = settings_lib.fingerprint(str(a))["content"]
    assert settings_lib.fingerprint(str(b))["content"] == same
    for where in (0, len(data) - 1):
        changed = bytearray(data)
        changed[where] ^= 0xFF
        b.write_bytes(changed)
        assert settings_lib.fingerprint(str(b))["content"] != same, where
    b.write_bytes(data + b"\x01")
    assert settings_lib.fingerprint(str(b))["content"] != same
    assert settings_lib.fingerprint("preset:tiny") == "preset:tiny"


def _parts_job(tmp_path, temperatures):
    """A two-process job's files, written as `generate` would: r0, r2 in part 0 and r1, r3 in part 1,
    each part with the record of its temperature."""
    prompts = write_jobs(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": [1, i + 2]} for i in range(4)])
    out = tmp_path / "out.jsonl"
    multihost.write_manifest(out, prompts)
    for part, temperature in enumerate(temperatures):
        path = multihost.part_path(out, part)
        settings_lib.record(path, {"temperature": temperature, "k": 2}, prompts)
        path.write_text("".join(json.dumps({"id": f"r{i}", "tokens": [i]}) + "\n" for i in (part, part + 2)))
    return out


def test_merge_refuses_parts_with_other_settings(tmp_path, capsys):
    out = _parts_job(tmp_path, [0.0, 0.7])
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli.main(["merge", str(out)]) == 2
    err = capsys.readouterr().err
    assert "temperature: 0.0 in out.jsonl.part-0, 0.7 in out.jsonl.part-1" in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before   # nothing written, nothing removed
    assert cli.main(["merge", str(out), "--allow-mixed-settings"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["r0", "r1", "r2", "r3"]
    saved = json.loads(settings_lib.sidecar(out).read_text())
    assert saved["settings"]["temperature"] == 0.0 and [m["settings"]["temperature"] for m in saved["mixed"]] == [0.7]
    assert not multihost.parts(out) and not list(tmp_path.glob("*.part-*"))   # parts and their records gone


def test_merge_of_agreeing_parts_keeps_their_record(tmp_path, capsys):
    out = _parts_job(tmp_path, [0.5, 0.5])
    assert cli.main(["merge", str(out)]) == 0
    saved = json.loads(settings_lib.sidecar(out).read_text())
    assert saved["settings"] == {"temperature": 0.5, "k": 2} and saved["mixed"] == [] and saved["from_line"] == 1
    assert len(read_output(out)) == 4
