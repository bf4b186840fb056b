"""docs/torch-versions.md is written whole from the committed records docs/torch-matrix/<minor>.json:
the page is byte for byte what the records give (a hand edit or a stale generator fails here), a run of
one torch rewrites that torch's record and keeps the others', and a broken record leaves the page as it is."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

# private: the tested torch versions, one record each
from pipecheck._core.torch_versions import TESTED_TORCH

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("torch_matrix", ROOT / "docs" / "torch_matrix.py")
assert spec is not None and spec.loader is not None
matrix = importlib.util.module_from_spec(spec)
sys.modules["torch_matrix"] = matrix
spec.loader.exec_module(matrix)


def test_the_page_is_what_the_committed_records_give() -> None:
    page = matrix.PAGE.read_text()
    assert matrix.render(matrix.load(matrix.DATA), page) == page, (
        "docs/torch-versions.md differs from docs/torch-matrix/*.json: run `python docs/torch_matrix.py write`")


def test_every_tested_torch_has_a_committed_record() -> None:
    assert sorted(path.stem for path in matrix.DATA.glob("*.json")) == sorted(TESTED_TORCH)


def test_a_run_of_one_torch_rewrites_its_record_and_the_page_keeps_the_others(tmp_path: Path, monkeypatch) -> None:
    data = tmp_path / "data"
    shutil.copytree(matrix.DATA, data)
    page = tmp_path / "page.md"
    page.write_text(matrix.PAGE.read_text())
    torch = pytest.importorskip("torch")
    mine = data / f"{matrix.minor(torch.__version__)}.json"
    if not mine.exists():
        pytest.skip(f"torch {torch.__version__} is not a tested one")
    before = json.loads(mine.read_text())
    cells = [{**cell, "text": "pass (max abs 1.0e-07)", "outcome": "pass"} for cell in before["zoo"]["cells"]]
    monkeypatch.setattr(matrix, "WORK", tmp_path / "work")
    monkeypatch.setattr(matrix, "_zoo", lambda path: {"date": "2030-01-02", "transformers": "9.9", "status": 0,
                                                      "seconds": 1, "cells": cells})
    monkeypatch.setattr(matrix, "_suite", lambda path: pytest.fail("--only zoo ran the suite"))
    if (before["torch"], before["python"]) != (torch.__version__, matrix.platform.python_version()):
        with pytest.raises(matrix.RecordError, match="measure both parts"):
            matrix.run(mine, ("zoo",))
        return
    matrix.run(mine, ("zoo",))
    after = json.loads(mine.read_text())
    assert after["suite"] == before["suite"] and after["zoo"]["date"] == "2030-01-02"
    matrix.write(data, page)
    text = page.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| model | schedules |"))
    assert [matrix.minor(cell.strip()) for cell in header.split("|")[3:-1]] == list(TESTED_TORCH)  # none lost
    assert f"suite {before['suite']['date']}, zoo 2030-01-02" in text and "| 9.9 |" in text


@pytest.mark.parametrize("damage,message", [
    pytest.param(lambda record: record["zoo"].pop("cells"), "lacks zoo.cells", id="no-cells"),
    pytest.param(lambda record: record["suite"].pop("date"), "lacks suite.date", id="no-date"),
    pytest.param(lambda record: record.update(torch="2.11.0"), "belongs in 2.11.json", id="wrong-file"),
])
def test_a_broken_record_leaves_the_page_as_it_is(damage, message: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(matrix.DATA, data)
    record = json.loads((data / f"{TESTED_TORCH[-1]}.json").read_text())
    damage(record)
    (data / f"{TESTED_TORCH[-1]}.json").write_text(json.dumps(record))
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- torch-matrix:begin -->\nold\n<!-- torch-matrix:end -->\nafter\n")
    with pytest.raises(matrix.RecordError, match=message):
        matrix.write(data, page)
    assert page.read_text() == "before\n<!-- torch-matrix:begin -->\nold\n<!-- torch-matrix:end -->\nafter\n"
