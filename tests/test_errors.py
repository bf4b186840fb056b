"""Bad inputs: each raises the right PipecheckError, naming the problem and the fix, quickly."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck import fixtures
from pipecheck.errors import TaskPickleError

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


class WritesItsWeight(AdjacentMarkers):
    """A forward that updates a parameter in place, under no_grad or through ``.data``."""

    def __init__(self, through_data: bool = False) -> None:
        super().__init__()
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:
            self.a.weight.data.mul_(1.01)
        else:
            with torch.no_grad():
                self.a.weight.mul_(1.01)
        return self.b(self.a(x))


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
    ("spec-int-key", lambda: pc.split(_mlp(), (X,), split_spec={1: BEGIN}),
     pc.SplitError, ("key 1 (int) is not a module FQN", "Did you mean 'layers.1'", "named_modules()")),
    ("spec-not-a-dict", lambda: pc.split(_mlp(), (X,), split_spec=["layers.1"]),
     pc.SplitError, ("split_spec must be a dict of module FQN -> SplitPoint, got a list",
                     "Fix: e.g. split_spec={'head': pc.SplitPoint.BEGINNING}")),
    ("forward-writes-a-parameter", lambda: _check(WritesItsWeight, split_spec={"b": BEGIN}),
     pc.InputError, ("WritesItsWeight's forward changes its parameter(s) 'a.weight' in place",
                     "Fix: compute the changed weight out of place")),
    ("forward-writes-a-parameter-data", lambda: _check(lambda: WritesItsWeight(through_data=True),
                                                       split_spec={"b": BEGIN}),
     pc.InputError, ("changes its parameter(s) 'a.weight' in place", "on its .data")),
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
     pc.InputError, ("inputs do not fit MLP.forward", "missing a required argument: 'x'",
                     "Fix: pass forward's parameters ['x']")),
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
    ("input-dtype-differs-from-model", lambda: _check(args=(X.double(),)),
     pc.InputError, ("the eager model failed on its inputs (RuntimeError",
                     "input x is float64 but the model's parameters are float32", "pass dtype=/device=")),
    ("input-device-differs-from-model", lambda: _check(args=(X.to("meta"),), n_microbatches=2),
     pc.InputError, ("failed on one micro-batch of its inputs",
                     "input x is on meta but the model's parameters are on cpu", "pass dtype=/device=")),
    ("world-size-does-not-fit-the-cut", lambda: _check(runner="distributed", world_size=4),
     pc.InputError, ("needs 1 rank but world_size is 4", "Fix: cut the model into 4 stages",
                     "policies.balanced_params(4)", "or use 1 rank (World(1) / world_size=1)")),
    # Wrong types are named up front, every one at once, never a bare TypeError from inside torch
    ("model-class-needing-arguments", lambda: _check(nn.Linear),
     pc.InputError, ("model=Linear is a class whose constructor needs in_features, out_features",
                     "model=lambda: Linear(...)")),
    ("kwargs-a-list", lambda: _check(kwargs=[X]), pc.InputError, ("kwargs must be a dict, got list",)),
    ("split-spec-a-list", lambda: _check(split_spec=["layers.1"]),
     pc.InputError, ("split_spec must be a dict, got list", "split_spec={'layers.2': pc.SplitPoint.BEGINNING}")),
    ("split-spec-an-int-key", lambda: _check(split_spec={1: BEGIN}),
     pc.InputError, ("split_spec has keys that are not names: [1]",)),
    ("policy-a-string", lambda: _check(policy="balanced"),
     pc.InputError, ("policy='balanced' is not a policy", "pc.policies.balanced_params(4)")),
    ("seed-a-string", lambda: _check(seed="abc"), pc.InputError, ("seed='abc' must be an int",)),
    ("world-a-string", lambda: _check(runner="distributed", world="..."),
     pc.InputError, ("world='...' is not a pc.World", "with pc.World(2) as world:")),
    ("world-size-negative", lambda: _check(runner="distributed", world_size=-1),
     pc.InputError, ("world_size=-1 must be a positive int",)),
    ("trace-path-in-a-missing-folder", lambda: _check(runner="distributed", trace_path="/no/such/folder/t.json"),
     pc.InputError, ("trace_path='/no/such/folder/t.json' is in a folder that does not exist",
                     "create the folder first")),
    ("numpy-input", lambda: _check(args=(X.numpy(),)),
     pc.InputError, ("args[0] is a numpy.ndarray", "torch.from_numpy(args[0])")),
    ("timeout-zero", lambda: _check(timeout=0), pc.InputError, ("timeout=0 must be a positive number",)),
    ("several-problems-at-once", lambda: _check(seed="abc", check_grads="no", n_microbatches=0),
     pc.InputError, ("called with 3 problems", "n_microbatches=0", "seed='abc'", "check_grads='no'")),
    ("run-pipeline-without-a-world", lambda: pc.run_pipeline(None, _mlp, (X,)),
     pc.InputError, ("run_pipeline: world=None is not a pc.World",)),
    ("negative-tolerance", lambda: pc.Tolerance(-1, 0),
     pc.InputError, ("pc.Tolerance(rtol=-1)", "finite numbers >= 0")),
    ("nan-tolerance", lambda: pc.Tolerance(1e-5, float("nan")), pc.InputError, ("pc.Tolerance(atol=nan)",)),
    ("zero-stage-policy", lambda: pc.policies.balanced_params(0),
     pc.SplitError, ("balanced_params(n_stages=0)", "positive int")),
    # Vacuous passes: each compared nothing, or less than asked
    ("empty-batch", lambda: _check(args=(X[:0],), n_microbatches=2),
     pc.InputError, ("args[0] has shape (0, 16): an empty batch", "nothing to compare")),
    ("empty-batch-one-microbatch", lambda: _check(args=(X[:0],)), pc.InputError, ("an empty batch",)),
    ("seed-too-large", lambda: _check(seed=2**64), pc.InputError, ("seed=18446744073709551616 must be an int in",)),
    ("empty-input-beside-a-batch", lambda: _check(args=(X, torch.zeros(0)), n_microbatches=2),
     pc.InputError, ("args[1] has shape (0,), an empty dim 0, beside inputs with a batch", "pc.Replicated(...)")),
    ("numpy-in-replicated", lambda: _check(args=(X, pc.Replicated(X.numpy()))),
     pc.InputError, ("args[1].value is a numpy.ndarray", "torch.from_numpy(args[1].value)")),
    ("microbatches-a-bool", lambda: _check(n_microbatches=True),
     pc.InputError, ("n_microbatches=True must be a positive int",)),
    ("check-grads-a-string", lambda: _check(check_grads="no"),
     pc.InputError, ("check_grads='no' must be True or False",)),
    ("world-size-does-not-fit-the-cut-torch",
     lambda: _check(runner="torch", world_size=3, policy=pc.policies.balanced_params(2), n_microbatches=2),
     pc.InputError, ("needs 2 ranks but world_size is 3", "Fix: cut the model into 3 stages")),
]


@pytest.mark.parametrize(("call", "error", "phrases"),
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_input_raises_a_readable_pipecheck_error(call: Callable[[], Any], error: type[pc.PipecheckError],
                                                     phrases: tuple[str, ...]) -> None:
    started = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    assert time.perf_counter() - started < 60, "a bad input must fail fast, not hang"
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


# --- errors wrapping the user's own code keep it as their cause -----------------------------------

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # spawned ranks unpickle _world_jobs by name; they inherit sys.path
    sys.path.insert(0, str(TESTS_DIR))
import _world_jobs as jobs  # noqa: E402


def _two_stages() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))


SPLIT_TWO = {"2": BEGIN}
X4, Y4 = torch.randn(4, 4), torch.randn(4, 4)


@pytest.mark.parametrize("run", [
    pytest.param(lambda: pc.assert_equivalent(_two_stages, (X4,), split_spec=SPLIT_TWO, loss_fn=jobs.exploding_loss,
                                              target=Y4, n_microbatches=2, runner="reference"), id="eager"),
    pytest.param(lambda: pc.DetachExecutor(pc.split(_two_stages(), (X4,), split_spec=SPLIT_TWO)).step(
        (X4,), loss_fn=jobs.exploding_loss, target=Y4, n_microbatches=2), id="reference"),
])
def test_a_raising_loss_fn_is_a_loss_error_naming_it(run: Callable[[], Any]) -> None:
    with pytest.raises(pc.LossError) as info:
        run()
    assert str(info.value) == (
        "loss_fn 'exploding_loss' raised ValueError: loss exploded on micro-batch 0 of 2 (outputs: Tensor(2, 4) "
        "float32; target: Tensor(2, 4) float32). Fix: make loss_fn(outputs, target) work on one micro-batch: "
        "outputs and target are split on dim 0, so each call sees 1/n_microbatches of the batch.")
    assert isinstance(info.value.__cause__, ValueError)  # the user's traceback stays reachable


def test_a_raising_loss_fn_on_a_rank_is_that_rank_s_loss_error() -> None:
    with pc.World(1, timeout=60, start_timeout=60) as world:
        with pytest.raises(pc.WorldError) as info:
            pc.run_pipeline(world, _two_stages, (X4,), n_microbatches=2, loss_fn=jobs.exploding_loss, target=Y4)
    error = info.value.error  # type: ignore[attr-defined]
    assert (error.exc_type, error.rank, error.stage) == ("pipecheck.errors.LossError", 0, 0)
    assert error.message.startswith("loss_fn 'exploding_loss' raised ValueError: loss exploded on micro-batch 0")


class WithLambda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.activation = lambda t: t.relu()  # pickle refuses a lambda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.activation(self.a(x)))


@pytest.mark.parametrize("runner,model,overrides,phrases", [
    pytest.param("distributed", lambda: _two_stages(), {}, ("the model factory '<lambda>' cannot be pickled",
                 "Fix: define it as a top-level function of an importable module"), id="factory-lambda"),
    pytest.param("torch", lambda: _two_stages(), {}, ("the model factory '<lambda>' cannot be pickled",
                 "Fix: define it as a top-level function"), id="factory-lambda-torch"),
    pytest.param("distributed", _two_stages, {"loss_fn": lambda out, target: (out - target).square().mean(),
                                             "target": Y4},
                 ("loss_fn '<lambda>'", "Fix: define it as a top-level function"), id="loss-fn-lambda"),
    pytest.param("deepspeed", _two_stages, {"loss_fn": lambda out, target: (out - target).square().mean(),
                                           "target": Y4},
                 ("loss_fn '<lambda>'", "Fix: define it as a top-level function"), id="loss-fn-lambda-deepspeed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")),
    pytest.param("torchtitan", lambda: _two_stages(), {}, ("the model factory '<lambda>' cannot be pickled",),
                 id="factory-lambda-torchtitan",
                 marks=pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")),
    pytest.param("distributed", WithLambda(), {"split_spec": {"b": BEGIN}},
                 ("the model (WithLambda) cannot be pickled", "Fix: pass a zero-argument factory"),
                 id="module-holding-a-lambda"),
])
def test_a_job_that_cannot_travel_names_the_part(runner: str, model: Any, overrides: dict[str, Any],
                                                 phrases: tuple[str, ...]) -> None:
    world = pc.World(2, timeout=60)  # never started: pickling fails before anything is sent
    try:
        with pytest.raises(TaskPickleError) as info:
            pc.assert_equivalent(model, (X4,), **{"split_spec": SPLIT_TWO, **overrides}, n_microbatches=2,
                                 runner=runner, world=world)
    finally:
        world.close()
    message = str(info.value)
    assert "cannot be pickled to send it to the ranks" in message
    for phrase in phrases:
        assert phrase in message, message
    assert world.pids == ()


def test_world_run_names_the_argument_it_cannot_pickle() -> None:
    world = pc.World(1)
    try:
        with pytest.raises(TaskPickleError, match=r"World.run\(\): kwargs\['scale'\] cannot be pickled"):
            world.run(jobs.echo, 1, scale=lambda: 2)
    finally:
        world.close()


class FixedBatch(nn.Module):
    """Hard-codes the batch size: runs on the whole batch, fails on a micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).reshape(8, 4)


@pytest.mark.parametrize("model,x,expected,not_expected", [
    pytest.param(FixedBatch, torch.randn(8, 4), "runs on the whole batch. With n_microbatches=2 each call sees 1/2",
                 "runs on these inputs eagerly", id="hard-coded-batch"),
    pytest.param(lambda: nn.Linear(4, 4), torch.arange(32).reshape(8, 4), "Fix: check that the model runs on "
                 "these inputs eagerly", "batch size", id="integer-input"),
])
def test_the_batch_size_hint_is_given_only_when_the_whole_batch_runs(model: Any, x: torch.Tensor, expected: str,
                                                                     not_expected: str) -> None:
    with pytest.raises(pc.InputError) as info:
        pc.assert_equivalent(model, (x,), runner="reference", n_microbatches=2)
    assert expected in str(info.value) and not_expected not in str(info.value), str(info.value)


def test_every_adapter_module_named_for_adapter_errors_exists() -> None:
    """A failure is pipecheck's adapter's (AdapterError) when raised in one of these files: a file
    moved or renamed without this list would turn adapter bugs into findings about the engine."""
    from pipecheck import errors

    assert errors._ADAPTERS and all(path.is_file() for path in errors._ADAPTERS), sorted(map(str, errors._ADAPTERS))
