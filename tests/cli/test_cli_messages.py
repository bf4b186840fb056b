"""What the command line says: every built-in runner in ``--help`` (from the registry), an engine's
failure in one line (the rank's traceback with ``--traceback``), and a model given by its file's path
(``my_model.py:Model``) imported from wherever pipecheck runs, with a fix that works when a file is not
there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipecheck._cli.main import error_message

# private: --help must list the registry's runners, every one of them
from pipecheck._runners import registry
from pipecheck.errors import AdapterError, EngineError, RankError, RankFailedError, WorldStartError

MODEL = '''
import torch
import pipecheck as pc


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        pc.pipe_split()
        g = self.b(h)
        pc.pipe_split()
        return self.c(g) + h  # h skips stage 1: torch.distributed.pipelining cannot run its backward
'''


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("PIPECHECK_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "pipecheck", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def pipecheck_lines(stderr: str) -> list[str]:
    """stderr without what torch's own logger prints from the ranks (``[rank0]:E1127 ...``)."""
    return [line for line in stderr.splitlines() if not line.startswith("[rank")]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_model.py").write_text(MODEL)
    (tmp_path / "elsewhere").mkdir()
    return tmp_path


# --- every built-in runner in --help ------------------------------------------------------------


@pytest.mark.parametrize("command", ["check", "zoo"])
def test_help_lists_every_builtin_runner_of_the_registry(command: str, tmp_path: Path) -> None:
    result = run_cli([command, "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert ", ".join(registry.RUNNERS) in text
    missing = [name for name, entry in registry.OPTIONAL.items() if not entry.available()]
    if missing:
        assert f"({', '.join(missing)}: not installed here; pip install \"torch-pipecheck[NAME]\")" in text


# --- an engine's failure in one line --------------------------------------------------------------

RANK_ERROR = RankError("torch.distributed.pipelining._utils.PipeliningMetadataError",
                       "Backward of skip connections not supported yet", 0, 0, "1B0",
                       "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nPipeliningMetadataError: ...\n")
WHERE = ("torch.distributed.pipelining failed on rank 0, stage 0, in schedule.step; schedule '1f1b', "
         "n_microbatches=4, stages_per_rank=1.")


@pytest.mark.parametrize("error,line", [
    pytest.param(EngineError(f"Backward of skip connections not supported yet\n{WHERE}\nTraceback on rank 0:\n"
                             f"{RANK_ERROR.traceback}", cause=RANK_ERROR),
                 f"pipecheck: engine error: Backward of skip connections not supported yet. {WHERE} Fix: rerun "
                 "with --traceback to see rank 0's traceback, where it failed.", id="engine"),
    pytest.param(AdapterError("TypeError: f() got an unexpected keyword argument 'x' (in pipecheck's adapter for "
                              "torch, pipecheck/_runners/torch_pipelining/rank.py:9 in step)\nThis is pipecheck's "
                              "error. Fix: report it with the traceback below.\nTraceback on rank 0:\n  ...",
                              cause=RANK_ERROR),
                 "pipecheck: pipecheck adapter error: TypeError: f() got an unexpected keyword argument 'x' (in "
                 "pipecheck's adapter for torch, pipecheck/_runners/torch_pipelining/rank.py:9 in step). This is "
                 "pipecheck's error. Fix: report it with the traceback below. (rerun with --traceback to see rank "
                 "0's traceback.)", id="adapter"),
    pytest.param(RankFailedError("rank 0 of 2 raised ValueError: bad while running stage 0 of task t.\nTraceback "
                                 "on rank 0:\n  ...", RANK_ERROR),
                 "pipecheck: runtime error: rank 0 of 2 raised ValueError: bad while running stage 0 of task t. Fix: "
                 "rerun with --traceback to see rank 0's traceback, where it failed.", id="rank-failed"),
])
def test_a_rank_s_failure_is_one_line_and_its_traceback_is_left_to_traceback(error: Exception, line: str) -> None:
    assert error_message(error) == line


def test_a_message_without_a_rank_s_traceback_is_kept_whole() -> None:
    """A World that cannot start says what each rank said; a hang's stacks are what a hang is fixed by."""
    start = WorldStartError("Could not start World(2):\nrank 1 failed to join the world:\n  OSError: no space\n"
                            "If gloo cannot bind an address, set GLOO_SOCKET_IFNAME.")
    assert error_message(start) == f"pipecheck: runtime error: {start}"
    hang = EngineError("torch did not finish within 5 s (rank 1 hung).\nPython stack of every rank:\n  ...")
    assert error_message(hang) == f"pipecheck: engine error: {hang}"


def test_torch_s_failure_on_the_command_line_is_one_line_and_traceback_adds_the_rank_s(user_dir: Path) -> None:
    args = ["check", "my_model:Model", "--input-shape", "8,4", "--runner", "torch"]
    result = run_cli(args, user_dir)
    assert result.returncode == 3, result.stderr
    # torch 2.15 raises its own PipeliningMetadataError (shown by its message), torch 2.10 a bare AssertionError
    # (shown with its type, as Python prints it)
    [line] = pipecheck_lines(result.stderr)
    assert re.fullmatch(
        r"pipecheck: engine error: (AssertionError: )?Backward of skip connections not supported yet\. "
        r"torch\.distributed\.pipelining failed on rank 0, stage 0, in schedule\.step; schedule '1f1b', "
        r"n_microbatches=4, stages_per_rank=1\. Fix: rerun with --traceback to see rank 0's traceback, where it "
        r"failed\.", line), result.stderr
    followed = run_cli([*args, "--traceback"], user_dir)
    assert followed.returncode == 3
    lines = pipecheck_lines(followed.stderr)
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == line
    assert "Traceback on rank 0:" in lines
    assert "PipeliningMetadataError" in followed.stderr or "AssertionError" in followed.stderr


# --- a model given by its file --------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["../my_model.py:Model", "{root}/my_model.py:Model"], ids=["relative", "absolute"])
def test_a_model_is_given_by_its_file_s_path_from_any_folder(spec: str, user_dir: Path) -> None:
    """The ranks import it too: the distributed runner runs it on worker processes."""
    result = run_cli(["check", spec.format(root=user_dir), "--input-shape", "8,4"], user_dir / "elsewhere")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pipecheck: runner 'distributed' matches eager (")


def test_a_file_inside_a_package_is_imported_as_its_module(tmp_path: Path) -> None:
    package = tmp_path / "src" / "shop"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text("import torch\n\ndef block():\n    return torch.nn.Linear(4, 4)\n")
    (package / "net.py").write_text("import torch\nfrom .layers import block\n\n"
                                    "def make():\n    return torch.nn.Sequential(block(), block())\n")
    result = run_cli(["check", "src/shop/net.py:make", "--input-shape", "8,4", "--stages", "2", "--runner",
                      "reference"], tmp_path)
    assert result.returncode == 0, result.stderr


def test_a_missing_file_s_fix_names_a_form_that_works(user_dir: Path) -> None:
    elsewhere = user_dir / "elsewhere"
    result = run_cli(["check", "my_model.py:Model", "--input-shape", "8,4", "--runner", "reference"], elsewhere)
    assert result.returncode == 2
    assert result.stderr == (
        f"pipecheck: usage error: the model factory names the file my_model.py, which does not exist (looked from "
        f"{elsewhere}). Fix: give the path of the .py file that defines Model, e.g. path/to/my_model.py:Model, or "
        "its module as package.module:Model.\n")
    followed = run_cli(["check", "../my_model.py:Model", "--input-shape", "8,4", "--runner", "reference"], elsewhere)
    assert followed.returncode == 0, followed.stderr
    module = run_cli(["check", "my_model:Model", "--input-shape", "8,4", "--runner", "reference"], elsewhere)
    assert "give the file's path (path/to/my_model.py:Model)" in module.stderr


def test_a_path_that_is_not_a_python_file_is_refused(user_dir: Path) -> None:
    result = run_cli(["check", "../my_model:Model", "--input-shape", "8,4"], user_dir / "elsewhere")
    assert result.returncode == 2
    assert result.stderr.startswith("pipecheck: usage error: the model factory ../my_model:Model is neither a "
                                    "module (dots, no '/') nor a .py file. Fix: ")


def test_a_file_whose_module_name_is_taken_is_named(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "argparse.py").write_text("def make():\n    return 1\n")  # the command line's argparse
    result = run_cli(["check", "mine/argparse.py:make", "--input-shape", "8,4"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"pipecheck: usage error: the model factory: importing {tmp_path}/mine/argparse.py "
                                    "as 'argparse' gave "), result.stderr
    assert result.stderr.endswith("another module of that name, already imported or earlier on sys.path. Fix: "
                                  "rename argparse.py.\n")


# --- a folder named pipecheck in the way ----------------------------------------------------------


def test_a_folder_named_pipecheck_that_hides_the_install_is_named(tmp_path: Path) -> None:
    """A checkout's root (no __init__.py) in the working directory: Python imports it as an empty namespace
    package where pipecheck is installed by a finder (pip install -e), and the command said it was a bug."""
    (tmp_path / "pipecheck").mkdir()
    found = subprocess.run([sys.executable, "-c", "import pipecheck; print(pipecheck.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "None":
        pytest.skip(f"pipecheck is found before the folder here ({found.stdout.strip()}): nothing hides it")
    result = run_cli(["zoo"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert pipecheck_lines(result.stderr) == [
        f"pipecheck: usage error: Python imported the folder {tmp_path / 'pipecheck'} as the package 'pipecheck' "
        "(it has no __init__.py: a checkout's root, run from the folder above it), not the installed pipecheck. "
        "Fix: run from another folder (inside the checkout, say), or rename that folder."]
