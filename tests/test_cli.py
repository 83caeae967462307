"""The command line, run in-process."""

import json

import pytest

from jaxspec import cli
from jaxspec.cost import CostModel


def test_profile_writes_a_loadable_cost_model(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert cli.main(["profile", "--target", "preset:tiny", "--draft", "preset:tiny", "--batches", "1,4",
                     "--ks", "0,2", "--cache-lens", "64,128", "--repeats", "2", "--output", str(out)]) == 0
    cost = CostModel.load(out)
    assert cost.target_name == "tiny" and cost.draft_name == "tiny"
    assert cost.verify_seconds(16, 0) > 0
    printed = capsys.readouterr().out
    assert "target_per_token" in printed and "r2" in printed
    assert json.loads(out.read_text())["fit"]["step"]["points"] == 8


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        cli.main(["profile", "--target", "preset:tiny", "--batches", "0,2"])
    assert "expected positive integers" in capsys.readouterr().err
