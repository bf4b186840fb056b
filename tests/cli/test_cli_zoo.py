"""`python -m pipecheck zoo` with one column per runner and schedule, written into a named README block."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipecheck._cli.main import main
from pipecheck._cli.zoo import markers, stages_per_rank_for


@pytest.mark.parametrize("runner,schedule,default,want", [
    ("distributed", "zbv", 1, 2), ("distributed", "zb", 2, 1), ("distributed", "gpipe", 2, 2),
    ("torch", "dualpipev", 1, 2), ("torch", "ScheduleZBVZeroBubble", 1, 2), ("torch", "interleaved_zb", 2, 2),
    ("torch", "1f1b", 2, 1),
])
def test_each_schedule_gets_the_stages_per_rank_it_runs(runner, schedule, default, want):
    assert stages_per_rank_for(runner, schedule, default) == want


def test_columns_are_written_into_their_block_and_refused_layouts_show_as_na(pipecheck_world, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]):
    pipecheck_world(2)  # the shared World the distributed column runs on
    readme = tmp_path / "README.md"
    begin, end = markers("zb")
    readme.write_text(f"intro\n{begin}\nold\n{end}\noutro\n")
    code = main(["zoo", "--models", "mlp,skip_one", "--columns", "distributed:zbv,reference:zb",
                 "--write-markdown", str(readme), "--block", "zb"])
    assert code == 0  # a refusal (n/a) is no failure
    block = readme.read_text().split(begin)[1].split(end)[0]
    mlp, skip_one = (next(line for line in block.splitlines() if line.startswith(f"| {name} ")) for name in
                     ("mlp", "skip_one"))
    assert "| distributed zbv" in block and "| reference zb" in block
    assert mlp.count("pass (max abs") == 2
    assert "n/a: 'zbv' needs an even number of stages" in skip_one
    assert "12 models" not in block and "2 models x 2 columns" in block
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("outro\n")
    assert "distributed zbv" in capsys.readouterr().out


def test_json_holds_every_cell_with_its_outcome_and_the_exit_status(tmp_path: Path) -> None:
    import json

    import torch

    out = tmp_path / "zoo.json"
    assert main(["zoo", "--models", "mlp,skip_one", "--columns", "reference:1f1b,reference:zbv",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["torch"], data["status"]) == (torch.__version__, 0)
    cells = {(c["model"], c["column"], c["schedule"]): c["outcome"] for c in data["cells"]}
    assert cells == {("mlp", "reference", "1f1b"): "pass", ("mlp", "reference", "zbv"): "pass",
                     ("skip_one", "reference", "1f1b"): "pass", ("skip_one", "reference", "zbv"): "pass"}
    assert all(c["text"].startswith("pass (max abs ") for c in data["cells"])
    assert data["summary"].startswith("2 models x 2 columns")


def test_an_unwritable_json_path_is_refused_before_the_zoo_runs(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "--models", "mlp", "--runners", "reference", "--json",
                 str(tmp_path / "missing" / "zoo.json")]) == 2
    err = capsys.readouterr()
    assert "cannot write --json" in err.err and "| mlp" not in err.out


def test_a_cell_that_raises_what_pipecheck_never_raises_is_an_internal_error_counted_everywhere() -> None:
    from pipecheck._cli.zoo import zoo_cell

    def broken() -> None:
        raise KeyError("a bug")

    cell = zoo_cell(broken)
    assert (cell.outcome, cell.text, cell.message) == ("internal", "INTERNAL ERROR KeyError: 'a bug'",
                                                       "KeyError: 'a bug'")


class Terminal:
    """A stream that says it is a terminal, keeping what is written."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_the_zoo_shows_its_progress_on_a_terminal_and_nothing_in_a_pipe(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    for tty in (True, False):
        terminal = Terminal(tty)
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["zoo", "--models", "mlp,skip_one", "--runners", "reference"]) == 0
        out = capsys.readouterr().out
        if tty:  # one line rewritten per cell, cleared before the table
            assert "zoo: 0/2 cells, mlp x reference, " in terminal.text
            assert "zoo: 1/2 cells, skip_one x reference, " in terminal.text
            assert terminal.text.endswith("\r\033[K") and "\n" not in terminal.text
        else:
            assert terminal.text == ""
        assert "zoo:" not in out and "| mlp" not in out and "mlp " in out


def test_training_adds_a_column_that_trains_on_the_runtime_with_data_parallel(
        pipecheck_world, capsys: pytest.CaptureFixture[str]) -> None:
    pipecheck_world(6)  # the training column: 2 data-parallel replicas of kwarg_default's 3 stages
    code = main(["zoo", "--models", "kwarg_default", "--runners", "reference", "--training", "--stages-per-rank", "1"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("model"))
    assert header.split()[-2:] == ["reference", "training"]
    row = next(line for line in out.splitlines() if line.startswith("kwarg_default"))
    assert row.count("pass (max abs") == 2, out
    assert code == 0
