"""The DeepSpeed and torchtitan examples of the README and of the guides under docs/ run as printed, as
programs (they start worker processes), when their engine is installed; each prints exactly the lines its
closing comments show (DeepSpeed's own log lines aside) and leaves nothing on stderr. Test ids name the
page: ``docs/engines.md:deepspeed``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS = re.compile(r'^# needs: pip install "torch-pipecheck\[(\w+)\]"')
ENGINE_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\] ")  # DeepSpeed's logger prints here


def _engine_blocks() -> list[tuple[str, str, str]]:
    """(page, extra, block) for every `# needs: pip install "torch-pipecheck[X]"` block of README.md and docs/*.md."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
            if match := NEEDS.match(block):
                found.append((path.relative_to(ROOT).as_posix(), match.group(1), block))
    return found


def _expected(block: str) -> list[str]:
    """The example's closing comment lines: what it prints, line by line."""
    closing: list[str] = []
    for line in reversed(block.rstrip().splitlines()):
        if not line.startswith("# "):
            break
        closing.insert(0, line[2:])
    return closing


def test_the_docs_have_an_example_per_engine() -> None:
    assert sorted({extra for _, extra, _ in _engine_blocks()}) == ["deepspeed", "megatron", "torchtitan"]


@pytest.mark.parametrize("extra,block", [pytest.param(e, b, id=f"{page}:{e}") for page, e, b in _engine_blocks()])
def test_an_engine_example_runs_and_prints_what_it_says(extra: str, block: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(extra) is None:
        pytest.skip(f'needs pip install "torch-pipecheck[{extra}]"')
    script = tmp_path / f"readme_{extra}.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
    printed = [line for line in done.stdout.splitlines() if not ENGINE_LOG.match(line)]
    expected = _expected(block)
    assert expected and printed == expected, done.stdout
