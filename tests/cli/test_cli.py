"""The command line, driven as a CI script drives it: a subprocess, its exit status, its first line.

Exit statuses as pytest's: 0 all match, 1 mismatch, 2 usage or input error, 3 engine or runtime
error, 4 internal error; every error is one ``pipecheck: <kind>: <what>. Fix: <how>`` line on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipecheck._cli.main import RUNNERS, classify
from pipecheck._runners import registry
from pipecheck.errors import (
    AdapterError,
    EngineError,
    EquivalenceError,
    InputError,
    LossError,
    RankError,
    RankFailedError,
    ScheduleError,
    SplitError,
    TaskPickleError,
    UsageError,
    WorldStartError,
)

# The user's module. torch is imported inside the functions, so a usage error found before the
# model is built costs no torch import.
MODELS = '''
def make_model(markers=True):
    import torch.nn as nn
    import pipecheck as pc

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block0 = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.block1 = nn.Linear(16, 4)

        def forward(self, x):
            x = self.block0(x)
            if markers:
                pc.pipe_split()
            return self.block1(x)

    return Net()


def make_uncut():
    return make_model(markers=False)


def make_inputs():
    import torch
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)


def raising_inputs():
    raise OSError("inputs.pt not found")


def broken_factory():
    raise ValueError("no weights file")


def doubled_grads(job):
    from pipecheck._runners.base import run_reference
    result = run_reference(job)
    result.grads = {name: 2 * grad for name, grad in result.grads.items()}
    return result


def make_deep():
    import torch.nn as nn

    # 26 layers, 52 parameter tensors: a report longer than a screen
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(26)])


def summed_grads(job):  # each micro-batch's loss not divided by n_microbatches
    from pipecheck._runners.base import run_reference
    result = run_reference(job)
    result.grads = {name: job.n_microbatches * grad for name, grad in result.grads.items()}
    return result


def raising_runner(job):
    raise RuntimeError("my engine crashed")


def mse(outputs, target):
    return ((outputs - target) ** 2).mean()


def make_target():
    import torch
    return torch.zeros(8, 4)


NOT_CALLABLE = 3
'''

CHECK = ["check", "models:make_model", "--inputs", "models:make_inputs"]
REFERENCE = [*CHECK, "--runner", "reference"]


def run_cli(args: list[str], cwd: Path, *, script: bool = False, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    installed = Path(sys.executable).parent / "pipecheck"
    launcher = [str(installed)] if script and installed.exists() else [sys.executable, "-m", "pipecheck"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("PIPECHECK_DEBUG", None)
    environment.update(env or {})
    return subprocess.run([*launcher, *args], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "README.md").write_text("# no zoo markers here\n")
    return tmp_path


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


# --- 2: usage and input errors ------------------------------------------------------------------

USAGE = [
    pytest.param([], "the following arguments are required: {zoo,check}", id="no-command"),
    pytest.param(["chek"], "argument {zoo,check}: invalid choice: 'chek'", id="command-typo"),
    pytest.param(["check", "models:make_model"], "one of the arguments --inputs --input-shape is required",
                 id="no-inputs"),
    pytest.param([*CHECK, "--stages", "1"], "argument --stages: must be at least 2", id="stages-1"),
    pytest.param([*CHECK, "--stages", "0"], "argument --stages: must be at least 2", id="stages-0"),
    pytest.param([*CHECK, "--stages=-1"], "argument --stages: must be at least 2", id="stages-negative"),
    pytest.param([*CHECK, "--stages", "two"], "argument --stages: 'two' is not a whole number",
                 id="stages-not-a-number"),
    pytest.param([*CHECK, "--n-microbatches", "0"], "argument --n-microbatches: must be at least 1",
                 id="n-microbatches-0"),
    pytest.param([*CHECK, "--timeout", "0"], "argument --timeout: must be more than 0 seconds", id="timeout-0"),
    pytest.param([*CHECK, "--device", "tpu"], "argument --device: invalid choice: 'tpu'", id="device-tpu"),
    pytest.param([*CHECK, "--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'",
                 id="schedule"),
    pytest.param([*CHECK, "--split-spec", "block1"], "'block1' is not FQN=BEGINNING or FQN=END",
                 id="split-spec-item"),
    pytest.param([*CHECK, "--stages", "2", "--split-spec", "block1=BEGINNING"],
                 "argument --split-spec: not allowed with argument --stages", id="stages-and-split-spec"),
    pytest.param(["check", "models", "--input-shape", "8,16"], "the model factory 'models' is not a "
                 "module:function path", id="model-path-without-colon"),
    pytest.param(["check", "no_such_module:make", "--input-shape", "8,16"],
                 "cannot import 'no_such_module' for the model factory: No module named 'no_such_module'",
                 id="unknown-module"),
    pytest.param(["check", "models:make_modle", "--input-shape", "8,16"],
                 "module 'models' has no attribute 'make_modle' for the model factory (did you mean "
                 "'make_model'", id="attribute-typo"),
    pytest.param(["check", "models:NOT_CALLABLE", "--input-shape", "8,16"],
                 "the model factory 'models:NOT_CALLABLE' is a int, not a function", id="not-callable"),
    pytest.param(["check", "models:make_model", "--input-shape", "8,x"], "--input-shape '8,x' is not a shape",
                 id="input-shape"),
    pytest.param([*CHECK, "--runner", "refrence"], f"runner 'refrence' is not one of {', '.join(registry.RUNNERS)}. "
                 "Did you mean 'reference'?", id="runner-typo"),
    pytest.param([*CHECK, "--runner", "models:no_runner"], "module 'models' has no attribute 'no_runner' for "
                 "--runner", id="runner-path"),
    pytest.param([*CHECK, "--target", "models:make_target"], "--target was given without --loss. Fix: add --loss",
                 id="target-without-loss"),
    pytest.param([*CHECK, "--loss", "models:mes"], "module 'models' has no attribute 'mes' for --loss (did you "
                 "mean 'mse'", id="loss-typo"),
    pytest.param(["zoo", "--models", "mlpp"], "--models: no zoo model or tag ['mlpp']; the zoo has",
                 id="zoo-model-typo"),
    pytest.param(["zoo", "--runners", "reference,torhc"], "runner 'torhc' is not one of", id="zoo-runner-typo"),
    pytest.param(["zoo", "--write-markdown", "README.md"], "README.md has no <!-- pipecheck-zoo:begin -->",
                 id="zoo-markdown-without-markers"),
]


@pytest.mark.parametrize("args,message", USAGE)
def test_a_usage_error_exits_2_with_one_pipecheck_line(args: list[str], message: str, user_dir: Path) -> None:
    result = run_cli(args, user_dir)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    line = first_line(result.stderr)
    assert line.startswith("pipecheck: usage error: ") and message in line and "Fix: " in line, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


def test_cuda_without_cuda_is_a_usage_error(user_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = run_cli([*CHECK, "--device", "cuda"], user_dir)
    assert result.returncode == 2
    assert first_line(result.stderr).startswith("pipecheck: usage error: --device cuda needs CUDA, but "
                                                "torch.cuda.is_available() is False")
    assert "Fix: use --device cpu" in result.stderr


def test_a_model_cut_into_one_stage_is_refused_with_how_to_cut(user_dir: Path) -> None:
    result = run_cli(["check", "models:make_uncut", "--inputs", "models:make_inputs", "--runner", "reference"],
                     user_dir)
    assert result.returncode == 2
    line = first_line(result.stderr)
    assert line.startswith("pipecheck: usage error: the model was cut into 1 stage, so the check")
    for way in ("pipe_split() markers", "--stages N", "--split-spec", "--allow-single-stage"):
        assert way in line


@pytest.mark.parametrize("args,message", [
    pytest.param(["check", "models:broken_factory", "--input-shape", "8,16", "--runner", "reference"],
                 "the model factory models:broken_factory raised ValueError: no weights file", id="factory"),
    pytest.param(["check", "models:make_model", "--inputs", "models:raising_inputs"],
                 "--inputs models:raising_inputs raised OSError: inputs.pt not found", id="inputs"),
    pytest.param(["check", "models:make_model", "--input-shape", "8,15", "--runner", "reference"],
                 "the eager model failed on one micro-batch of its inputs (RuntimeError", id="input-shape-misfit"),
])
def test_an_input_error_exits_2(args: list[str], message: str, user_dir: Path) -> None:
    result = run_cli(args, user_dir)
    assert result.returncode == 2, result.stderr
    line = first_line(result.stderr)
    assert line.startswith("pipecheck: input error: ") and message in line and "Fix: " in line, result.stderr


# --- 0, 1, 3 and 4 --------------------------------------------------------------------------------


def test_a_match_exits_0_with_the_report_on_stdout(user_dir: Path) -> None:
    result = run_cli(REFERENCE, user_dir, script=True)
    assert result.returncode == 0, result.stderr
    assert first_line(result.stdout) == ("pipecheck: runner 'reference' matches eager (6 tensors; can see errors "
                                         ">= 0.001% on every row; tolerance auto, float32, 2 stages split by fx, "
                                         "4 micro-batches)")
    assert result.stderr == ""


def test_a_loss_and_its_target_are_given_by_module_path(user_dir: Path) -> None:
    result = run_cli([*REFERENCE, "--loss", "models:mse", "--target", "models:make_target", "-v"], user_dir)
    assert result.returncode == 0, result.stderr
    assert "\nloss " in result.stdout
    without = run_cli([*REFERENCE, "--loss", "models:mse"], user_dir)  # the loss needs its target
    assert without.returncode == 2, without.stdout
    assert "no target was given, so loss_fn was called with target=None: pass target=" in without.stderr


@pytest.mark.parametrize("extra,stages", [(["--allow-single-stage"], "1 stage"), (["--stages", "2"], "2 stages")])
def test_an_uncut_model_is_checked_when_cut_or_allowed(extra: list[str], stages: str, user_dir: Path) -> None:
    result = run_cli(["check", "models:make_uncut", "--inputs", "models:make_inputs", "--runner", "reference",
                      *extra], user_dir)
    assert result.returncode == 0, result.stderr
    assert f"float32, {stages} split by fx, 4 micro-batches)" in first_line(result.stdout)


def test_a_mismatch_exits_1_with_the_failure_table(user_dir: Path) -> None:
    result = run_cli([*CHECK, "--runner", "models:doubled_grads"], user_dir)
    assert result.returncode == 1, result.stderr
    assert first_line(result.stdout).startswith("pipecheck: runner 'doubled_grads' does not match eager (4 of 6 "
                                                "tensors fail;")
    assert "grad block0.0.weight" in result.stdout


DEEP = ["check", "models:make_deep", "--inputs", "models:make_inputs", "--stages", "4"]
SCALING_HINT = ("  hint (52 rows: grad 0.weight ... grad 25.bias): gradient scaling: gradient is n_microbatches (=4) "
                "times too large; each micro-batch's loss must be divided by n_microbatches")


def test_a_long_mismatch_is_cut_to_40_lines_and_verbose_prints_every_row(user_dir: Path) -> None:
    cut = run_cli([*DEEP, "--runner", "models:summed_grads"], user_dir)
    assert cut.returncode == 1, cut.stderr
    lines = cut.stdout.splitlines()
    assert lines[1].startswith("no boundary value diverges") and "handles gradients" in lines[1]
    assert len(lines) == 40 and lines[2:4] == ["failing rows by kind:  outputs 0 of 1, loss 0 of 1, grads 52 of 52",
                                               "failing rows by stage: 0: 14 of 14, 1: 12 of 12, 2: 14 of 14, "
                                               "3: 12 of 14"]
    assert lines[8] == SCALING_HINT
    assert lines[-1].endswith(" of 52 failing rows left out: rerun with -v to see every row")
    every = run_cli([*DEEP, "--runner", "models:summed_grads", "-v"], user_dir)
    assert every.returncode == 1, every.stderr
    names = [line.split("  ")[0] for line in every.stdout.splitlines()[4:] if not line.startswith("  hint")]
    assert names == ["output", "loss"] + [f"grad {i}.{p}" for i in range(26) for p in ("weight", "bias")]
    assert every.stdout.count("hint") == 1 and SCALING_HINT in every.stdout


def test_a_long_match_prints_its_first_rows_and_verbose_every_row(user_dir: Path) -> None:
    cut = run_cli([*DEEP, "--runner", "reference"], user_dir)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.splitlines()[-1] == "... 19 of 54 rows left out (all match): rerun with -v to see every row"
    every = run_cli([*DEEP, "--runner", "reference", "--verbose"], user_dir)
    assert every.returncode == 0, every.stderr
    assert len(every.stdout.splitlines()) == 2 + 2 + 54 and "left out" not in every.stdout


def test_an_engine_error_exits_3_in_one_line(user_dir: Path) -> None:
    result = run_cli([*CHECK, "--runner", "models:raising_runner"], user_dir)
    assert result.returncode == 3, result.stderr
    assert result.stderr == ("pipecheck: engine error: runner 'raising_runner' failed to run the job: "
                             "RuntimeError: my engine crashed. Fix: rerun with --traceback to see where it failed.\n")


INTERNAL = ("import pipecheck._cli.main as cli\n"
            "def boom(args):\n"
            "    return 1 / 0\n"
            "cli.cmd_check = boom\n"
            "raise SystemExit(cli.main(['check', 'models:make_model', '--input-shape', '8,16'] + EXTRA))\n")


@pytest.mark.parametrize("extra,env", [([], {}), (["--traceback"], {}), ([], {"PIPECHECK_DEBUG": "1"})],
                         ids=["plain", "--traceback", "PIPECHECK_DEBUG"])
def test_an_unexpected_exception_is_an_internal_error_exit_4(extra: list[str], env: dict[str, str],
                                                            user_dir: Path) -> None:
    code = f"EXTRA = {extra!r}\n{INTERNAL}"
    environment = {key: value for key, value in os.environ.items() if key != "PIPECHECK_DEBUG"}
    result = subprocess.run([sys.executable, "-c", code], cwd=user_dir, capture_output=True, text=True,
                            timeout=120, env={**environment, **env})
    assert result.returncode == 4
    message = ("pipecheck: internal error: ZeroDivisionError: division by zero. This is a bug in pipecheck, not "
               "in your model. Fix: rerun the command with --traceback")
    lines = result.stderr.splitlines()
    if extra or env:
        assert lines[0] == "Traceback (most recent call last):" and lines[-1].startswith(message)
    else:
        assert len(lines) == 1 and lines[0].startswith(message)


def test_classify_maps_every_pipecheck_error_to_its_exit_status() -> None:
    rank_error = RankError("ValueError", "boom", 1, 0, "0F0", "Traceback ...")
    assert classify(EquivalenceError("x")) == (1, "mismatch")
    assert classify(UsageError("x")) == (2, "usage error")
    for error in (InputError("x"), SplitError("x"), ScheduleError("x"), LossError("x"), TaskPickleError("x")):
        assert classify(error) == (2, "input error")
    assert classify(EngineError("x")) == (3, "engine error")
    assert classify(AdapterError("x")) == (4, "pipecheck adapter error")
    assert classify(RankFailedError("x", rank_error)) == (3, "runtime error")
    assert classify(WorldStartError("x")) == (3, "runtime error")
    assert classify(KeyError("x")) == (4, "internal error")


# --- --help -------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [True, False], ids=["pipecheck", "python -m pipecheck"])
def test_help_says_pipecheck_and_lists_the_exit_statuses(script: bool, user_dir: Path) -> None:
    result = run_cli(["--help"], user_dir, script=script)
    assert result.returncode == 0
    assert first_line(result.stdout).startswith("usage: pipecheck [-h]")
    assert "exit status:\n  0  every check matches eager\n  1  a mismatch" in result.stdout
    assert "zoo exits 0 when every cell" in result.stdout


def test_check_help_shows_defaults(user_dir: Path) -> None:
    result = run_cli(["check", "--help"], user_dir)
    assert result.returncode == 0
    assert first_line(result.stdout).startswith("usage: pipecheck check [-h]")
    text = " ".join(result.stdout.split())
    for shown in ("(default: distributed)", "(default: 4)", "(default: 1f1b)", "(default: float32)",
                  "(default: cpu)", "(default: auto)", "(default: 120.0)", "--allow-single-stage"):
        assert shown in text


def test_the_cli_knows_every_builtin_runner_and_each_installed_engine() -> None:
    # private: the registry's list, which the command line must show
    from pipecheck._runners.base import available_runners

    assert list(RUNNERS) == available_runners()


def test_modules_import_from_the_current_directory_as_with_python_m(tmp_path: Path, monkeypatch) -> None:
    """The `pipecheck` script's sys.path starts with its bin directory, not the current one; spawned
    ranks inherit the driver's sys.path, so they import the user's module from there too."""
    from pipecheck._cli.options import load_object

    name = f"cli_models_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("def make():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert load_object(f"{name}:make", "the model factory")() == 7
    assert sys.path[0] == str(tmp_path)
