"""pipecheck's name on the package index is ``torch-pipecheck`` (the index's ``pipecheck`` is another
project): pyproject says it, and every install line and fix text in the repository says it, so a user who
follows one outside a checkout installs pipecheck. The import name, the ``pipecheck`` command and the
pytest plugin keep the name ``pipecheck``."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

# private: the registry holds the distribution's name and the runners' extras that every fix text uses
from pipecheck._runners.registry import DISTRIBUTION, OPTIONAL, install_command

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Where install lines and fix texts live (CHANGELOG.md is history: it says what older versions printed).
SEARCHED = ("pipecheck", "fixtures", "tests", "benchmarks", "docs", "README.md", "noxfile.py", ".ci/run",
            "pyproject.toml")
# `pip install` of the bare name, with or without options or an extra, or a requirement of it with an extra:
# the other project. (This file's own examples of it are left out of the search.)
WRONG = re.compile(r"pip3? install(?:\s+-\S+)*\s+[\"']?pipecheck\b(?![-_.])|[\"'`]pipecheck\[")


def _texts() -> list[Path]:
    files: list[Path] = []
    for name in SEARCHED:
        path = ROOT / name
        files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".toml", ".txt", ".cfg")
                        and "__pycache__" not in p.parts) if path.is_dir() else [path]
    return [path for path in files if path != Path(__file__).resolve()]


def test_pyproject_names_the_distribution_the_texts_say() -> None:
    assert PYPROJECT["project"]["name"] == DISTRIBUTION == "torch-pipecheck"
    assert PYPROJECT["project"]["scripts"] == {"pipecheck": "pipecheck._cli.main:main"}
    assert PYPROJECT["project"]["entry-points"]["pytest11"] == {"pipecheck": "pipecheck.plugin"}


@pytest.mark.parametrize("line,wrong", [
    ('pip install "pipecheck[deepspeed]"', True), ("pip install pipecheck", True), ("pip install -U pipecheck", True),
    ('needs "pipecheck[megatron]"', True), ('pip install "torch-pipecheck[deepspeed]"', False),
    ("pip install torch-pipecheck", False), ('pip install -e ".[deepspeed]"', False),
    ("pip install pipecheck-tools", False), ('"pipecheck[{extra}]"', True),
])
def test_the_wrong_name_is_recognised(line: str, wrong: bool) -> None:
    assert bool(WRONG.search(line)) is wrong


def test_no_install_line_or_fix_text_names_the_other_project() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in _texts()
             for number, line in enumerate(path.read_text().splitlines(), 1) if WRONG.search(line)]
    assert not found, f"these install the index's unrelated `pipecheck`; say {DISTRIBUTION!r}:\n" + "\n".join(found)


def test_every_optional_runner_names_an_extra_pyproject_has_in_its_fix() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name, entry in OPTIONAL.items():
        assert entry.extra in extras, name
        assert install_command(entry.extra) == f'pip install "torch-pipecheck[{entry.extra}]"'
    assert install_command() == "pip install torch-pipecheck"


def test_the_installed_metadata_provides_the_plugin_and_the_command() -> None:
    """Whatever this environment installed pipecheck as (an older editable install says "pipecheck"),
    the pytest plugin and the command are found through its metadata."""
    plugins = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "pipecheck"]
    if not plugins:
        pytest.skip("pipecheck is not installed here (imported from the source tree)")
    assert {e.value for e in plugins} == {"pipecheck.plugin"}
    names = {e.dist.name for e in plugins if e.dist is not None}
    if DISTRIBUTION not in names:
        pytest.skip(f"installed under an older name ({', '.join(sorted(names))}); reinstall to see {DISTRIBUTION}")
    assert importlib.metadata.version(DISTRIBUTION) == PYPROJECT["project"]["version"]
    shown = subprocess.run([sys.executable, "-m", "pip", "show", DISTRIBUTION], capture_output=True, text=True,
                           timeout=120)
    assert f"Name: {DISTRIBUTION}" in shown.stdout, shown.stderr
