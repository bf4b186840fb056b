"""The README's DeepSpeed and torchtitan examples run as printed, as programs (they start worker
processes), when their engine is installed; each prints exactly the lines its closing comments show
(DeepSpeed's own log lines aside) and leaves nothing on stderr."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS = re.compile(r'^# needs: pip install "pipecheck\[(\w+)\]"')
ENGINE_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\] ")  # DeepSpeed's logger prints here


def _engine_blocks() -> list[tuple[str, str]]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [(match.group(1), block) for block in blocks if (match := NEEDS.match(block))]


def _expected(block: str) -> list[str]:
    """The example's closing comment lines: what it prints, line by line."""
    closing: list[str] = []
    for line in reversed(block.rstrip().splitlines()):
        if not line.startswith("# "):
            break
        closing.insert(0, line[2:])
    return closing


def test_the_readme_has_an_example_per_engine() -> None:
    assert sorted(extra for extra, _ in _engine_blocks()) == ["deepspeed", "torchtitan"]


@pytest.mark.parametrize("extra,block", [pytest.param(e, b, id=e) for e, b in _engine_blocks()])
def test_an_engine_example_runs_and_prints_what_it_says(extra: str, block: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(extra) is None:
        pytest.skip(f'needs pip install "pipecheck[{extra}]"')
    script = tmp_path / f"readme_{extra}.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
    printed = [line for line in done.stdout.splitlines() if not ENGINE_LOG.match(line)]
    expected = _expected(block)
    assert expected and printed == expected, done.stdout
