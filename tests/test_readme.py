"""The README runs as written: every python block, and the `pipecheck check` lines of its command line.

Each block is written to a fresh directory under the name its first line gives (``# my_model.py``)
or ``readme_block_N.py``; a block with a ``def test_`` is run by pytest, a ``World.from_env()`` script
by torchrun on two ranks, any other as a script, each in its own process with a timeout. A ``# pipecheck: ...`` comment in a block is output the block
promises: it must be printed. No block may leave a warning or a traceback on stderr.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipecheck._cli import EXIT_STATUSES

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 300
# What a clean run never prints: warnings (torch's own included), leaked multiprocessing objects, tracebacks.
NOISE = re.compile(r"Warning|warn\(|resource_tracker|leaked|Traceback|bootstrapping phase")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _file_name(index: int, block: str) -> str:
    first = block.splitlines()[0]
    named = re.match(r"# (\w+\.py)\b", first)
    return named.group(1) if named else f"readme_block_{index}.py"


def _check_commands() -> list[str]:
    """The README's `pipecheck check` lines that run in one process (their own runner, or "reference").

    The distributed line checks the same file as the `my_model.py` block's own distributed check, which
    runs above; starting its worker processes again would only add time to the suite.
    """
    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S))
    return [line for line in bash.splitlines()
            if line.startswith("pipecheck check ") and re.search(r"--runner (reference|\w+:\w+)", line)]


def _write_blocks(directory: Path) -> dict[str, str]:
    files = {_file_name(i, block): block for i, block in enumerate(_python_blocks())}
    for name, block in files.items():
        (directory / name).write_text(block)
    return files


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _clean(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    noise = [line for line in result.stderr.splitlines() if NOISE.search(line)]
    assert noise == [], f"{what} printed on stderr:\n{result.stderr}"


def _core_blocks() -> list[int]:
    """Blocks that need only pipecheck; those starting `# needs: pip install "pipecheck[X]"` are run by
    test_readme_engines.py when X is installed."""
    return [i for i, block in enumerate(_python_blocks()) if not block.startswith("# needs: ")]


@pytest.mark.parametrize("index", _core_blocks(), ids=[_file_name(i, _python_blocks()[i]) for i in _core_blocks()])
def test_every_python_block_runs_as_written(index: int, tmp_path: Path) -> None:
    block = _python_blocks()[index]
    name = _file_name(index, block)
    _write_blocks(tmp_path)  # a block may import another (my_engine.py, my_model.py)
    if re.search(r"^def test_", block, flags=re.M):
        result = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name], tmp_path)
        assert re.search(r"\b1 passed\b", result.stdout), result.stdout
    elif "pc.World.from_env()" in block:  # a torchrun script: two ranks on this machine
        result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       name], tmp_path)
    else:
        result = _run([sys.executable, name], tmp_path)
    _clean(result, name)
    promised = [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("# pipecheck: ")]
    for line in promised:
        assert line in result.stdout, f"{name} promises {line!r}; it printed:\n{result.stdout}"


def test_the_readme_s_blocks_are_complete_programs() -> None:
    for index, block in enumerate(_python_blocks()):
        assert block.lstrip().startswith(("import ", "from ", "# ")), f"block {index} starts mid-program"
        starts_workers = re.search(r"pc\.World\(|runner=\"(distributed|torch)\"|run_pipeline\(", block)
        if starts_workers and "def test_" not in block:
            assert 'if __name__ == "__main__":' in block, f"block {index} starts workers without a main guard"


def test_the_command_line_section_checks_both_example_files() -> None:
    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S))
    assert "pipecheck check my_model:Model --inputs my_model:make_inputs\n" in bash  # the Use block's file
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


def test_the_readme_documents_every_exit_status() -> None:
    text = README.read_text()
    for status, meaning in EXIT_STATUSES.items():
        assert f"| {status} | {meaning} |" in text


def test_the_zoo_table_is_generated_into_its_markers() -> None:
    text = README.read_text()
    block = text.split("<!-- pipecheck-zoo:begin -->", 1)[1].split("<!-- pipecheck-zoo:end -->", 1)[0]
    assert "generated by `python -m pipecheck zoo" in block
    assert all(name in block for name in ("mlp", "tiny_gpt", "long_skip", "kwarg_last"))


def test_the_zero_bubble_table_is_generated_into_its_block():
    text = README.read_text()
    block = text.split("<!-- pipecheck-zoo-zero-bubble:begin -->", 1)[1].split(
        "<!-- pipecheck-zoo-zero-bubble:end -->", 1)[0]
    assert "generated by `python -m pipecheck zoo --columns distributed:zb" in block
    assert "--block zero-bubble" in block
    assert all(name in block for name in ("distributed zbv", "torch dualpipev", "tiny_gpt", "long_skip"))
