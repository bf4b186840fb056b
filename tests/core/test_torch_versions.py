"""The supported torch range is one fact, stated once and kept true: pyproject's floor, the nox matrix,
CI's floor run and the measured page docs/torch-versions.md all follow ``TESTED_TORCH``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipecheck._core.torch_versions import TESTED_TORCH, at_least, minor
from pipecheck._core.torch_versions import (
    tested_note as note_on,  # named so pytest does not collect it
)

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_s_floor_is_the_oldest_tested_torch() -> None:
    floors = re.findall(r'^\s*"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert floors == [TESTED_TORCH[0]]


def test_every_tested_torch_has_its_column_on_the_measured_page() -> None:
    page = (ROOT / "docs" / "torch-versions.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| model | schedules |"))
    measured = {minor(cell.strip()) for cell in header.split("|")[3:] if cell.strip()}
    assert measured == set(TESTED_TORCH), "run `nox -s matrix` (or the missing versions) to measure them"


@pytest.mark.parametrize("version,floor,expected", [
    ("2.10.0+cu128", "2.10", True), ("2.10.0", "2.11", False), ("2.15.0", "2.11", True), ("2.9.1", "2.10", False),
    ("2.13.0+cpu", "2.13", True), ("3.0.0", "2.15", True),
])
def test_versions_compare_by_minor_release(version: str, floor: str, expected: bool) -> None:
    assert at_least(version, floor) is expected


def test_the_note_says_where_a_version_stands() -> None:
    assert note_on("2.16.0").endswith(f"to {TESTED_TORCH[-1]} (docs/torch-versions.md in its repository); this is torch "
                                          "2.16.0, not one of them")
    assert note_on(f"{TESTED_TORCH[0]}.1+cpu").endswith("one of them") and "not" not in note_on("2.13.0")
