"""The README and the guides under docs/ run as written: every python block, and the `pipecheck check`
lines of the command line (docs/command-line.md).

Every page's blocks are written to one fresh directory (a block may import another, wherever each is
printed), each under the name its first line gives (``# my_model.py``) or ``<page>_block_N.py``; a block
with a ``def test_`` is run by pytest, a ``World.from_env()`` script by torchrun on two ranks, any other
as a script, each in its own process with a timeout. A ``# pipecheck: ...`` comment in a block is output
the block promises: it must be printed. No block may leave a warning or a traceback on stderr. Test ids
name the page: ``docs/engines.md:my_engine.py``. Every relative link between the pages resolves.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# private: the command line's exit-status table, which the docs must show
from pipecheck._cli.main import EXIT_STATUSES

# private: the torch versions the nox matrix session is parametrized with, which the docs name
from pipecheck._core.torch_versions import TESTED_TORCH

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
# What a clean run never prints: warnings (torch's own included), leaked multiprocessing objects, tracebacks.
NOISE = re.compile(r"Warning|warn\(|resource_tracker|leaked|Traceback|bootstrapping phase")


def _pages() -> dict[str, str]:
    """README.md and every docs/*.md, by their path from the repository root."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in paths}


@dataclass(frozen=True)
class Block:
    page: str  # "README.md", "docs/engines.md"
    index: int  # among the page's python blocks
    text: str

    @property
    def file_name(self) -> str:
        named = re.match(r"# (\w+\.py)\b", self.text.splitlines()[0])
        if named:
            return named.group(1)
        stem = "readme" if self.page == "README.md" else re.sub(r"\W", "_", self.page.removesuffix(".md"))
        return f"{stem}_block_{self.index}.py"

    @property
    def id(self) -> str:
        return f"{self.page}:{self.file_name}"


def _python_blocks() -> list[Block]:
    return [Block(page, index, block) for page, text in _pages().items()
            for index, block in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S))]


def _bash() -> str:
    return "\n".join(block for text in _pages().values() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S))


def _check_commands() -> list[str]:
    """The pages' `pipecheck check` lines that run in one process (their own runner, or "reference").

    The distributed line checks the same file as the `my_model.py` block's own distributed check, which
    runs above; starting its worker processes again would only add time to the suite.
    """
    return [line for line in _bash().splitlines()
            if line.startswith("pipecheck check ") and re.search(r"--runner (reference|\w+:\w+)", line)]


def _write_blocks(directory: Path) -> dict[str, str]:
    files = {block.file_name: block.text for block in _python_blocks()}
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _clean(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    noise = [line for line in result.stderr.splitlines() if NOISE.search(line)]
    assert noise == [], f"{what} printed on stderr:\n{result.stderr}"


def _core_blocks() -> list[Block]:
    """Blocks that need only pipecheck; those starting `# needs: pip install "torch-pipecheck[X]"` are run by
    test_readme_engines.py when X is installed."""
    return [block for block in _python_blocks() if not block.text.startswith("# needs: ")]


def test_every_block_has_a_file_name_of_its_own() -> None:
    names = [block.file_name for block in _python_blocks()]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)


@pytest.mark.parametrize("block", _core_blocks(), ids=[block.id for block in _core_blocks()])
def test_every_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    name = block.file_name
    _write_blocks(tmp_path)  # a block may import another (my_engine.py, my_model.py), from any page
    if re.search(r"^def test_", block.text, flags=re.M):
        result = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name], tmp_path)
        assert re.search(r"\b1 passed\b", result.stdout), result.stdout
    elif "pc.World.from_env()" in block.text:  # a torchrun script: two ranks on this machine
        result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       name], tmp_path)
    else:
        result = _run([sys.executable, name], tmp_path)
    _clean(result, block.id)
    promised = [line.strip()[2:] for line in block.text.splitlines() if line.strip().startswith("# pipecheck: ")]
    for line in promised:
        assert line in result.stdout, f"{block.id} promises {line!r}; it printed:\n{result.stdout}"
    shown = _shown_output(block)
    if shown is not None:
        assert_prints(shown, result.stdout, block.id)


def _shown_output(block: Block) -> list[str] | None:
    """The lines its page shows the block printing: a fenced block after "`python <file>` prints ...:"."""
    found = re.search(rf"`python {re.escape(block.file_name)}` prints[^\n]*:\n\n```\n(.*?)```",
                      _pages()[block.page], flags=re.S)
    return found.group(1).splitlines() if found else None


# A number a report prints; after "atol " it is a tolerance made from eager's own float32 rounding error,
# which another CPU's kernels (another summation order) move: there within a factor of 4, elsewhere exact.
NUMBER = re.compile(r"(atol )?(\d+\.\d+e[+-]\d+)")


def _same_line(shown: str, printed: str) -> bool:
    if NUMBER.sub("#", shown) != NUMBER.sub("#", printed):
        return False
    pairs = zip(NUMBER.finditer(shown), NUMBER.finditer(printed))
    return all(a.group(2) == b.group(2) or (a.group(1) and 0.25 <= float(a.group(2)) / float(b.group(2)) <= 4)
               for a, b in pairs)


def assert_prints(shown: list[str], stdout: str, what: str) -> None:
    """Every line the page shows (``...``: lines left out) is printed, in that order, numbers included."""
    printed = stdout.splitlines()
    at = 0
    for line in (line for line in shown if line.strip() != "..."):
        at = next((i for i in range(at, len(printed)) if _same_line(line, printed[i])), -1)
        assert at >= 0, f"{what}: the page shows {line!r}, which it no longer prints; it printed:\n{stdout}"
        at += 1


@pytest.mark.parametrize("shown,printed,same", [
    ("max abs error 5.68e-01 (2.1e+00)", "max abs error 5.68e-01 (2.1e+00)", True),
    ("max abs error 3.59e-01 (1.8e+00)", "max abs error 5.68e-01 (2.1e+00)", False),
    ("auto: atol 9.8e-08 rtol 2.4e-07  (6, 1)", "auto: atol 1.0e-07 rtol 2.4e-07  (6, 1)", True),
    ("auto: atol 9.8e-08 rtol 2.4e-07  (6, 1)", "auto: atol 1.0e-07 rtol 2.4e-07  (5, 3)", False),
    ("auto: atol 9.8e-08 rtol 2.4e-07", "auto: atol 1.0e-06 rtol 2.4e-07", False),
])
def test_a_shown_line_matches_the_printed_one_numbers_included(shown: str, printed: str, same: bool) -> None:
    assert _same_line(shown, printed) is same


def test_the_pages_that_show_output_say_which_block_prints_it() -> None:
    shown = [block.id for block in _core_blocks() if _shown_output(block) is not None]
    assert "docs/reading-a-failure.md:off_by_one.py" in shown
    printing = sum(len(re.findall(r"`python \w+\.py` prints[^\n]*:\n\n```\n", text)) for text in _pages().values())
    assert len(shown) == printing, "a page shows the output of a block that is not on it"


def test_the_pages_blocks_are_complete_programs() -> None:
    for block in _python_blocks():
        assert block.text.lstrip().startswith(("import ", "from ", "# ")), f"{block.id} starts mid-program"
        starts_workers = re.search(r"pc\.World\(|runner=\"(distributed|torch)\"|run_pipeline\(", block.text)
        if starts_workers and "def test_" not in block.text:
            assert 'if __name__ == "__main__":' in block.text, f"{block.id} starts workers without a main guard"


def test_the_command_line_section_checks_both_example_files() -> None:
    assert "pipecheck check my_model:Model --inputs my_model:make_inputs\n" in _bash()  # the Use block's file
    assert len(_check_commands()) == 1  # the my_engine.py line, run below


@pytest.mark.parametrize("command", _check_commands())
def test_the_command_line_examples_run_as_written(command: str, tmp_path: Path) -> None:
    _write_blocks(tmp_path)
    script = Path(sys.executable).parent / "pipecheck"  # the installed script, as the README says
    words = shlex.split(command)
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "pipecheck"]
    result = _run([*launcher, *words[1:]], tmp_path)
    _clean(result, command)
    assert result.stdout.startswith("pipecheck: runner "), result.stdout
    assert " matches eager " in result.stdout.splitlines()[0]


def test_the_docs_document_every_exit_status() -> None:
    rows = [f"| {status} | {meaning} |" for status, meaning in EXIT_STATUSES.items()]
    assert [page for page, text in _pages().items() if all(row in text for row in rows)], rows


def _generated_block(block: str | None) -> tuple[str, str]:
    """The one page holding the zoo command's marked block, and the block's text."""
    name = "pipecheck-zoo" if block is None else f"pipecheck-zoo-{block}"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    holders = [page for page, text in _pages().items() if begin in text]
    assert len(holders) == 1, f"{begin} is in {holders}"
    return holders[0], _pages()[holders[0]].split(begin, 1)[1].split(end, 1)[0]


def test_the_zoo_table_is_generated_into_its_markers() -> None:
    page, block = _generated_block(None)
    assert f"generated by `python -m pipecheck zoo --write-markdown {page}`" in block  # the page it sits in
    assert all(name in block for name in ("mlp", "tiny_gpt", "long_skip", "kwarg_last"))


def test_the_zero_bubble_table_is_generated_into_its_block():
    page, block = _generated_block("zero-bubble")
    assert "generated by `python -m pipecheck zoo --columns distributed:zb" in block
    assert f"--write-markdown {page} --block zero-bubble" in block
    assert all(name in block for name in ("distributed zbv", "torch dualpipev", "tiny_gpt", "long_skip"))


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(next(f"{slug}-{n}" if n else slug for n in range(100) if (f"{slug}-{n}" if n else slug)
                         not in anchors))
    return anchors


def test_every_relative_link_between_the_pages_resolves() -> None:
    broken = []
    for page, text in _pages().items():
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            if not file.resolve().exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and anchor not in _anchors(file.read_text()):
                broken.append(f"{page}: {target} (no such heading)")
    assert broken == []


def test_every_nox_session_the_pages_name_is_in_the_noxfile() -> None:
    sessions = set(re.findall(r"@nox\.session(?:\(.*\))?\n(?:@nox\.parametrize\(.*\)\n)?def (\w+)\(",
                              (ROOT / "noxfile.py").read_text()))
    named = {name for text in _pages().values() for name in re.findall(r"nox -s \"?(\w+)", text)}
    assert {"tests", "matrix"} <= named and named <= sessions, f"no such nox session: {named - sessions}"
    parametrized = {value for text in _pages().values() for value in re.findall(r"matrix\(torch='([\d.]+)'\)", text)}
    assert parametrized <= set(TESTED_TORCH)
