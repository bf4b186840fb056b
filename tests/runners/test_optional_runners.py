"""Optional runners (DeepSpeed, torchtitan): listed only when their engine is installed, a clear
InputError with the pip command when it is not, and the zoo command's exit code counting only
pipecheck's own runners."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import pipecheck as pc

# private: runner names are resolved by the check and listed by the command line
from pipecheck._check.equivalence import resolve_runner
from pipecheck._cli.main import main
from pipecheck._runners import base as _runners
from pipecheck._runners import registry as _optional_runners


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend exactly the given engine packages are installed (looked up by find_spec, never imported)."""

    def pretend(*packages: str) -> None:
        real = importlib.util.find_spec

        def find_spec(name: str, *args: Any) -> Any:
            if name in {r.package for r in _optional_runners.OPTIONAL.values()}:
                return real("pipecheck") if name in packages else None
            return real(name, *args)

        monkeypatch.setattr(_optional_runners.importlib.util, "find_spec", find_spec)

    return pretend


@pytest.mark.parametrize("packages,expected", [
    ((), ["reference", "distributed", "torch"]),
    (("deepspeed",), ["reference", "distributed", "torch", "deepspeed"]),
    (("deepspeed", "torchtitan"), ["reference", "distributed", "torch", "deepspeed", "torchtitan"]),
    (("megatron",), ["reference", "distributed", "torch", "megatron"]),
])
def test_an_optional_runner_is_listed_only_when_its_engine_is_installed(installed: Any, packages: tuple[str, ...],
                                                                        expected: list[str]) -> None:
    installed(*packages)
    assert _runners.available_runners() == expected


@pytest.mark.parametrize("name", ["deepspeed", "torchtitan", "megatron"])
def test_an_engine_that_is_not_installed_is_an_input_error_with_the_fix(installed: Any, name: str) -> None:
    installed()
    with pytest.raises(pc.InputError, match=rf'runner={name!r} needs {name}, which is not installed. Fix: pip '
                                            rf'install "torch-pipecheck\[{name}\]"'):
        resolve_runner(name)


def test_an_unknown_runner_lists_the_optional_ones_too() -> None:
    with pytest.raises(pc.InputError, match="'deepspeed', 'torchtitan', 'megatron'"):
        resolve_runner("colossalai")


def test_the_zoo_exit_code_counts_only_pipecheck_s_own_runners(capsys: pytest.CaptureFixture[str]) -> None:
    if not _optional_runners.OPTIONAL["torchtitan"].available():
        pytest.skip('needs torchtitan: pip install "torch-pipecheck[torchtitan]"')
    # torchtitan cannot cut nested_spec (refused in this process, before any World): an ERROR cell,
    # and the command still succeeds.
    assert main(["zoo", "--models", "nested_spec", "--runners", "reference,torchtitan"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nested_spec"))
    assert "pass (max abs" in row
    assert "ERROR EngineError: torchtitan cannot cut where pipecheck cuts" in row


@pytest.mark.parametrize("command", [["zoo", "--models", "mlp", "--runners", "reference,{name}"],
                                     ["check", "models:make_model", "--input-shape", "8,4", "--runner", "{name}"]])
@pytest.mark.parametrize("name", ["deepspeed", "torchtitan"])
def test_the_cli_names_the_pip_command_for_an_engine_not_installed(
        installed: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str],
        name: str) -> None:
    from pipecheck._cli import options as _cli_options

    installed()
    monkeypatch.setattr(_cli_options, "RUNNERS",
                        tuple(r for r in _cli_options.RUNNERS if r not in _optional_runners.OPTIONAL))
    assert main([part.format(name=name) for part in command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipecheck: input error: runner={name!r} needs {name}, which is not installed. "
                          f'Fix: pip install "torch-pipecheck[{name}]"'), err


@pytest.mark.parametrize("name,canonical", [
    ("pipecheck-runtime", "distributed"), ("Torch-Pipelining", "torch"), ("detach-executor", "reference"),
    (" reference ", "reference"), ("TORCH", "torch"),
])
def test_a_runner_is_found_by_any_of_its_names(name: str, canonical: str) -> None:
    """Aliases say whose engine runs; case, spaces and "-" vs "_" do not matter; the report names
    the runner as it was given."""
    given, run = resolve_runner(name)
    assert given == name.strip() and run is resolve_runner(canonical)[1]


def test_a_check_reports_the_runner_under_the_name_it_was_given() -> None:
    report = pc.assert_equivalent(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                                  (torch.randn(8, 4),), split_spec={"1": pc.SplitPoint.BEGINNING},
                                  runner="detach-executor", n_microbatches=2)
    assert report.runner == "detach-executor" and str(report).startswith("pipecheck: runner 'detach-executor' matches eager")


def test_the_torch_runner_brings_its_own_split_under_any_of_its_names() -> None:
    """A failing check locates the first divergence against the runner's own split
    (``reference_boundaries``): torch's, whatever the name it was given by."""
    for name in ("torch", "Torch", "torch-pipelining"):
        assert callable(getattr(resolve_runner(name)[1], "reference_boundaries", None)), name


def test_the_command_line_s_single_stage_refusal_keeps_the_runner_s_own_split() -> None:
    from pipecheck._cli.main import RefusingSingleStage

    class OwnSplit:
        __name__ = "own_split"

        def reference_boundaries(self, job: Any) -> Any:
            return "the runner's own"

        def __call__(self, job: Any) -> Any:
            raise AssertionError("not run here")

    wrapped = RefusingSingleStage("own_split", OwnSplit())
    assert wrapped.reference_boundaries(None) == "the runner's own"
