"""Bad inputs: each raises the right PipecheckError, naming the problem and the fix, quickly."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck import fixtures

zoo_models = fixtures.models

PIPECHECK_DIR = Path(pc.__file__).resolve().parent
X = torch.randn(8, zoo_models.WIDTH)
BEGIN, END = pc.SplitPoint.BEGINNING, pc.SplitPoint.END


def _mlp() -> nn.Module:
    return zoo_models.MLP(markers=False)


class AdjacentMarkers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(zoo_models.WIDTH, zoo_models.WIDTH)
        self.b = nn.Linear(zoo_models.WIDTH, zoo_models.WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        pc.pipe_split()
        pc.pipe_split()
        return self.b(x)


class MarkerFirst(AdjacentMarkers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pc.pipe_split()
        return self.b(self.a(x))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(zoo_models.WIDTH, zoo_models.WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return -self.a(x)


class UnusedChild(AdjacentMarkers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _check(model: Any = _mlp, args: Any = (X,), runner: Any = "reference", **kw: Any) -> pc.Report:
    return pc.assert_equivalent(model, args, runner=runner, **kw)


def _broken_runner(job: pc.Job) -> pc.StepResult:
    raise RuntimeError("engine exploded")


def _not_a_result(job: pc.Job) -> Any:
    return {"outputs": None}


# (id, call, error type, phrases that must appear in the message)
CASES: list[tuple[str, Callable[[], Any], type[pc.PipecheckError], tuple[str, ...]]] = [
    ("spec-unknown-fqn", lambda: pc.split(_mlp(), (X,), split_spec={"layer.1": BEGIN}),
     pc.SplitError, ("'layer.1' is not a submodule of MLP", "Did you mean 'layers.1'", "named_modules()")),
    ("spec-several-problems-at-once",
     lambda: pc.split(_mlp(), (X,), split_spec={"layer.1": BEGIN, "head": "middle"}),
     pc.SplitError, ("'layer.1' is not a submodule", "'head': split point 'middle' is not SplitPoint")),
    ("spec-module-never-called", lambda: pc.split(UnusedChild(), (X,), split_spec={"b": BEGIN}),
     pc.SplitError, ("forward never calls: ['b']", "Fix: cut at a module that runs")),
    ("adjacent-markers-fx", lambda: pc.split(AdjacentMarkers(), (X,)),
     pc.SplitError, ("leave stage(s) [1] of 3 empty", "remove the extra pipe_split()")),
    ("adjacent-markers-export", lambda: pc.split(AdjacentMarkers(), (X,), tracer="export"),
     pc.SplitError, ("leave stage(s) [1] of 3 empty",)),
    ("marker-at-start", lambda: pc.split(MarkerFirst(), (X,)),
     pc.SplitError, ("leave stage(s) [0] of 2 empty", "a cut at the very start")),
    ("spec-cut-at-start", lambda: pc.split(_mlp(), (X,), split_spec={"layers.0": BEGIN}),
     pc.SplitError, ("leave stage(s) [0] of 2 empty",)),
    ("spec-cut-at-end", lambda: pc.split(_mlp(), (X,), split_spec={"head": END}),
     pc.SplitError, ("leave stage(s) [1] of 2 empty",)),
    ("spec-two-cuts-same-place",
     lambda: pc.split(_mlp(), (X,), split_spec={"layers.1": END, "layers.2": BEGIN}),
     pc.SplitError, ("leave stage(s) [1] of 3 empty",)),
    ("too-many-stages", lambda: pc.split(_mlp(), (X,), policy=pc.policies.balanced_nodes(1000)),
     pc.SplitError, ("more stages requested than the graph allows (stages: 1000, compute nodes: 13)",
                     "ask for at most 13 stages")),
    ("too-many-stages-params", lambda: pc.split(_mlp(), (X,), policy=pc.policies.balanced_params(14)),
     pc.SplitError, ("stages: 14, compute nodes: 13",)),
    ("spec-and-policy",
     lambda: pc.split(_mlp(), (X,), split_spec={"layers.1": BEGIN}, policy=pc.policies.balanced_nodes(2)),
     pc.SplitError, ("both split_spec and policy", "pass one of them")),
    ("spec-and-policy-check",
     lambda: _check(split_spec={"layers.1": BEGIN}, policy=pc.policies.balanced_nodes(2)),
     pc.SplitError, ("both split_spec and policy",)),
    ("policy-bad-cuts", lambda: pc.split(_mlp(), (X,), policy=lambda units: [0, 5]),
     pc.SplitError, ("returned cuts [0, 5]", "1..12, strictly increasing")),
    ("policy-zero-cap", lambda: pc.split(_mlp(), (X,), policy=pc.policies.param_bytes_buckets(0)),
     pc.SplitError, ("cap_bytes=0", "positive cap")),
    ("control-flow-fx", lambda: pc.split(DataDependent(), (X,), tracer="fx"),
     pc.TraceError, ("torch.fx could not trace DataDependent", "control flow", "tracer='export'")),
    ("control-flow-auto", lambda: pc.split(DataDependent(), (X,)),
     pc.TraceError, ("neither tracer could trace DataDependent", "  fx: torch.fx could not trace",
                     "  export: torch.export could not trace")),
    ("control-flow-export", lambda: pc.split(DataDependent(), (X,), tracer="export"),
     pc.TraceError, ("torch.export could not trace DataDependent", "data-dependent", "tracer='fx'")),
    ("control-flow-check", lambda: _check(DataDependent),
     pc.TraceError, ("neither tracer could trace DataDependent", "tried fx, then export")),
    ("batch-not-divisible", lambda: _check(n_microbatches=3),
     pc.InputError, ("input['x'] has batch size 8", "not divisible by n_microbatches=3",
                     "a multiple of 3")),
    ("batch-not-divisible-executor",
     lambda: pc.DetachExecutor(pc.split(_mlp(), (X,))).step((X,), n_microbatches=3),
     pc.InputError, ("input['x'] has batch size 8", "n_microbatches=3")),
    ("target-not-divisible",
     lambda: _check(loss_fn=torch.nn.functional.mse_loss, target=torch.zeros(6, 4), n_microbatches=4),
     pc.InputError, ("target has batch size 6", "n_microbatches=4")),
    ("zero-microbatches", lambda: _check(n_microbatches=0),
     pc.InputError, ("n_microbatches=0 must be a positive int",)),
    ("loss-not-scalar", lambda: _check(loss_fn=lambda out, t: out * t, target=torch.ones(8, 4)),
     pc.LossError, ("returned a tensor of shape (8, 4)", "must return a scalar tensor", "reduce it")),
    ("loss-not-a-tensor", lambda: _check(loss_fn=lambda out, t: 1.0, target=torch.ones(8, 4)),
     pc.LossError, ("returned float", "scalar tensor")),
    ("target-without-loss", lambda: _check(target=torch.ones(8, 4)),
     pc.InputError, ("target was given without loss_fn", "pass loss_fn=")),
    ("kwarg-not-in-signature-split", lambda: pc.split(_mlp(), (X,), {"y": X}),
     pc.InputError, ("kwargs ['y'] are not parameters of MLP.forward", "pass only ['x']")),
    ("kwarg-not-in-signature-check", lambda: pc.assert_equivalent(_mlp, (X,), {"y": X}, runner="reference"),
     pc.InputError, ("kwargs ['y'] are not parameters of MLP.forward", "pass only ['x']")),
    ("missing-input", lambda: pc.split(_mlp(), ()),
     pc.InputError, ("inputs do not fit MLP.forward", "missing a required argument: 'x'")),
    ("unknown-tracer-split", lambda: pc.split(_mlp(), (X,), tracer="dynamo"),
     pc.SplitError, ("tracer='dynamo' is not known", "tracer='fx'", "tracer='export'")),
    ("unknown-tracer-check", lambda: _check(tracer="dynamo"),
     pc.SplitError, ("tracer='dynamo' is not known",)),
    ("unknown-runner", lambda: pc.assert_equivalent(_mlp, (X,), runner="nope"),
     pc.InputError, ("runner='nope' is not known", "'reference'", "runner(job: pc.Job)")),
    ("tolerance-number", lambda: _check(tolerance=1e-3),
     pc.InputError, ("tolerance=0.001 is not understood", "pc.Tolerance(rtol=..., atol=...)")),
    ("tolerance-unknown-word", lambda: _check(tolerance="loose"),
     pc.InputError, ("tolerance='loose' is not understood", "'auto', 'exact'")),
    ("model-not-a-module", lambda: pc.split(3, (X,)),
     pc.InputError, ("model must be an nn.Module or a zero-argument factory", "got int")),
    ("factory-returns-non-module-split", lambda: pc.split(lambda: 3, (X,)),
     pc.InputError, ("returned int, not an nn.Module",)),
    ("factory-returns-non-module-check", lambda: _check(lambda: 3),
     pc.InputError, ("returned int, not an nn.Module",)),
    ("runner-raises", lambda: _check(runner=_broken_runner),
     pc.EngineError, ("runner '_broken_runner' failed to run the job", "RuntimeError: engine exploded")),
    ("runner-returns-wrong-type", lambda: _check(runner=_not_a_result),
     pc.EngineError, ("runner '_not_a_result' returned dict", "pc.StepResult")),
]


@pytest.mark.parametrize(("call", "error", "phrases"),
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_input_raises_a_readable_pipecheck_error(call: Callable[[], Any], error: type[pc.PipecheckError],
                                                     phrases: tuple[str, ...]) -> None:
    started = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    assert time.perf_counter() - started < 30, "a bad input must fail fast, not hang"
    assert type(info.value) is error, f"{type(info.value).__name__} is not {error.__name__}: {info.value}"
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in:\n{message}"
    # Raised by pipecheck on purpose, without a torch exception chained underneath it.
    if error is not pc.EngineError:  # EngineError keeps the engine's own exception as its cause
        assert info.value.__cause__ is None
        assert info.value.__context__ is None or info.value.__suppress_context__
    assert Path(info.traceback[-1].path).resolve().is_relative_to(PIPECHECK_DIR)
    assert len(message.splitlines()) <= 8
