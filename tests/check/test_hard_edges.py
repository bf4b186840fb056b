"""Odd but correct models are never reported as mismatches, and a check never changes what it is given.

Each case here was a false alarm, a foreign error or a mutated model before it was fixed: a factory
that draws from an RNG pipecheck does not seed, randomness a few ulps deep, dataclass outputs, a
forward that writes into its input or assigns a buffer, checks from two threads, NaN from a runner.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings

import pipecheck as pc
from pipecheck import fixtures
from pipecheck import strategies as pst

# private: the reference runner's function, wrapped to plant bugs
from pipecheck._runners.base import run_reference

TESTS_DIR = Path(__file__).resolve().parents[1]
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
if str(TESTS_DIR) not in sys.path:  # spawned ranks unpickle _world_jobs by name; they inherit sys.path
    sys.path.insert(0, str(TESTS_DIR))
import _odd_models  # noqa: E402

CUT = {"b": pc.SplitPoint.BEGINNING}
X = torch.randn(8, 4)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _check(model: Any, args: Any = (X,), **options: Any) -> pc.Report:
    return pc.assert_equivalent(model, args, **{"split_spec": CUT, "n_microbatches": 2, "runner": "reference",
                                                **options})


# --- a factory pipecheck's seed does not make reproducible ------------------------------------------

def test_a_factory_that_draws_from_numpy_builds_the_same_model_in_every_process() -> None:
    # pipecheck seeds numpy's and Python's RNGs with torch's (and restores them after); the torch runner's
    # ranks build the whole model from the factory (the distributed runner's hold the driver's weights)
    state = np.random.get_state()[1].copy()
    assert _check(_odd_models.numpy_initialised_model, runner="torch").ok
    assert np.array_equal(np.random.get_state()[1], state)


def test_a_factory_that_builds_other_weights_each_call_passes_where_ranks_hold_the_drivers_weights() -> None:
    assert _check(_odd_models.urandom_initialised_model, runner="distributed").ok


def test_a_factory_that_builds_other_weights_each_call_is_named_not_the_pipeline() -> None:
    with pytest.raises(pc.InputError) as info:  # the torch runner's ranks build their own from the factory
        _check(_odd_models.urandom_initialised_model, runner="torch")
    message = str(info.value)
    assert "the model factory 'urandom_initialised_model' builds different weights on each call" in message
    assert "'a.weight' differs between two calls under seed 0" in message
    assert "os.urandom" in message


def test_a_reproducible_factory_that_fails_is_still_an_equivalence_error() -> None:
    def halves_grads(job: pc.Job) -> pc.StepResult:
        result = run_reference(job)
        result.grads = {name: grad / 2 for name, grad in result.grads.items()}
        return result

    with pytest.raises(pc.EquivalenceError):
        _check(TwoLayers, runner=halves_grads)


class ScratchBuffer(TwoLayers):
    """A buffer made with torch.empty that forward never reads: other bytes on each build, same model."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scratch", torch.empty(1000))


def _outputs_off_by_one_percent(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = result.outputs * 1.01
    return result


def test_a_factory_whose_weights_are_reproducible_keeps_its_failure_table() -> None:
    with pytest.raises(pc.EquivalenceError, match="does not match eager"):
        _check(ScratchBuffer, runner=_outputs_off_by_one_percent)


def test_a_module_that_cannot_be_deep_copied_says_to_pass_a_factory() -> None:
    model = TwoLayers()
    model.b = torch.nn.utils.weight_norm(model.b)  # the old weight_norm: its hook refuses deepcopy
    with pytest.raises(pc.InputError, match="cannot be copied .*Fix: pass a zero-argument factory"):
        _check(model)


def test_a_raising_factory_is_named_with_its_error_as_the_cause() -> None:
    def make() -> nn.Module:
        raise FileNotFoundError("weights.pt")

    with pytest.raises(pc.InputError, match="the model factory '.*make' raised FileNotFoundError: weights.pt") as info:
        _check(make)
    assert isinstance(info.value.__cause__, FileNotFoundError)


# --- randomness: refused, never compared -------------------------------------------------------------

class StochasticDepth(nn.Module):
    """ConvNeXt's pattern: a randomly dropped branch behind a 1e-6 layer scale (moves outputs by ulps)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 4)
        self.branch = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.full((16,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        keep = torch.empty(h.shape[0], 1).bernoulli_(0.5) / 0.5
        return self.b(h + self.scale * self.branch(h) * keep)


class OwnGeneratorStochasticDepth(StochasticDepth):
    """The same, drawing from a generator of its own: torch's global RNG never moves."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        keep = torch.empty(h.shape[0], 1).bernoulli_(0.5, generator=self.generator) / 0.5
        return self.b(h + self.scale * self.branch(h) * keep)


class DefaultGeneratorStochasticDepth(StochasticDepth):
    """Torch's default generator, passed explicitly: not a generator of its own, and left as found."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        keep = torch.empty(h.shape[0], 1).bernoulli_(0.5, generator=torch.default_generator) / 0.5
        return self.b(h + self.scale * self.branch(h) * keep)


class PythonRandomScale(TwoLayers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + 1e-6 * random.random())


class DropoutOfZero(TwoLayers):
    """Draws from the RNG (dropout in train mode) but p=0 changes nothing: deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


@pytest.mark.parametrize("model", [StochasticDepth, DefaultGeneratorStochasticDepth], ids=lambda m: m.__name__)
def test_randomness_from_torch_s_default_generator_a_few_ulps_deep_is_checked_by_the_contract(
        model: type[nn.Module]) -> None:
    state = torch.get_rng_state()
    if model is DefaultGeneratorStochasticDepth and TORCH_VERSION < (2, 13):  # export cannot trace the argument
        with pytest.raises(pc.InputError, match="no tracer could trace it .*torch < 2.13 cannot trace a "
                                                "torch.Generator argument: draw without generator="):
            _check(model)
        return
    report = _check(model)
    assert report.ok and "1 random op drawn by pipecheck's randomness contract" in report.headline()
    assert torch.equal(torch.get_rng_state(), state)  # the contract's seeding left torch's RNG as found


@pytest.mark.parametrize("model", [OwnGeneratorStochasticDepth, PythonRandomScale], ids=lambda m: m.__name__)
def test_randomness_a_few_ulps_deep_outside_the_contract_is_refused_as_randomness(model: type[nn.Module]) -> None:
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(pc.InputError) as info:
        _check(model)
    drew = {OwnGeneratorStochasticDepth: "aten.bernoulli_, from a torch.Generator of its own",
            PythonRandomScale: "Python's or numpy's RNG"}[model]
    assert f"{model.__name__} is not deterministic: its forward draws random numbers ({drew}), and its outputs " \
           "follow the seed" in str(info.value)
    assert "come back bit for bit under the same one" in str(info.value)
    # The probe seeds and draws from the caller's RNGs only inside fork_rng / saved states
    assert torch.equal(torch.get_rng_state(), state[0])
    assert random.getstate() == state[1]
    assert np.array_equal(np.random.get_state()[1], state[2])


class ShuffleBatchNorm(nn.Module):
    """MoCo's shuffle-BN: a random permutation, undone after the BatchNorm; the draw only reorders a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = torch.randperm(x.shape[0])
        return self.b(self.bn(self.a(x)[order])[torch.argsort(order)])


@pytest.mark.parametrize("model", [DropoutOfZero, ShuffleBatchNorm], ids=lambda m: m.__name__)
def test_a_model_that_draws_but_whose_values_do_not_depend_on_the_draw_is_checked(model: type[nn.Module]) -> None:
    assert _check(model, (torch.randn(16, 4),)).ok


# --- outputs a tracer can build but pytree cannot open ---------------------------------------------

@dataclasses.dataclass
class PlainOutput:
    y: torch.Tensor
    hidden: torch.Tensor


@dataclasses.dataclass
class RegisteredOutput:
    y: torch.Tensor
    hidden: torch.Tensor


pytree.register_dataclass(RegisteredOutput)


class ReturnsDataclass(TwoLayers):
    output_class: Any = PlainOutput

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.relu(self.a(x))
        return self.output_class(self.b(hidden), hidden)


class ReturnsRegisteredDataclass(ReturnsDataclass):
    output_class = RegisteredOutput


def _loss_of_y(outputs: Any, target: Any) -> torch.Tensor:
    return outputs.y.square().mean()


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
@pytest.mark.parametrize("loss_fn", [None, _loss_of_y], ids=["default-loss", "loss-fn"])
def test_a_plain_dataclass_output_is_refused_with_the_registration_fix(tracer: str, loss_fn: Any) -> None:
    with pytest.raises(pc.SplitError) as info:
        _check(ReturnsDataclass, tracer=tracer, loss_fn=loss_fn)
    assert "forward returns an object of class PlainOutput, which torch.utils._pytree does not know" in str(info.value)
    assert "torch.utils._pytree.register_dataclass" in str(info.value)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_registered_dataclass_output_is_compared_field_by_field(tracer: str) -> None:
    report = _check(ReturnsRegisteredDataclass, tracer=tracer)
    assert {"output.y", "output.hidden"} <= {row.name for row in report.rows}


# --- forwards that write: into their input, into a buffer -------------------------------------------

class WritesIntoItsInput(TwoLayers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return super().forward(x)


class CountsInputs(TwoLayers):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen += x.mean(0)
        return super().forward(x)


def test_a_forward_that_writes_into_its_input_is_checked_and_the_caller_s_input_kept() -> None:
    x = X.clone()
    assert _check(WritesIntoItsInput(), (x,)).ok
    assert torch.equal(x, X)


def test_a_buffer_assigned_in_forward_is_traced_by_export_and_compared() -> None:
    model = CountsInputs()
    report = _check(model)
    assert report.tracer == "export"  # fx cannot record `self.seen += ...`; auto takes export
    assert report.row("buffer seen").ok
    assert type(model._buffers["seen"]) is torch.Tensor and not model.seen.any()


def test_fx_names_the_buffer_it_cannot_record_and_leaves_the_module_as_it_was() -> None:
    model = CountsInputs()
    with pytest.raises(pc.TraceError, match=r"forward assigns or registers self\.seen"):
        pc.split(model, (X,), split_spec=CUT, tracer="fx")
    assert type(model._buffers["seen"]) is torch.Tensor


class CachesOnFirstCall(TwoLayers):
    """The old rotary-embedding pattern: a buffer registered on the first forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "cache" not in self._buffers:
            self.register_buffer("cache", torch.ones(4), persistent=False)
        return super().forward(x * self.cache)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_buffer_registered_on_the_first_call_is_refused_and_the_module_left_as_it_was(tracer: str) -> None:
    model = CachesOnFirstCall()
    with pytest.raises(pc.TraceError) as info:
        pc.split(model, (X,), split_spec=CUT, tracer=tracer)
    assert "forward assigns or registers self.cache while it runs" in str(info.value)
    assert "Fix: register every buffer in __init__" in str(info.value)
    assert "cache" not in model._buffers


# --- threads, NaN, a loss that needs a target -------------------------------------------------------

def test_checks_in_two_threads_of_one_process_do_not_interfere() -> None:
    verdicts: list[bool] = []
    errors: list[BaseException] = []

    def checks() -> None:
        try:
            for _ in range(8):
                verdicts.append(_check(TwoLayers).ok)
        except BaseException as err:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=checks) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors[0]
    assert verdicts == [True] * 16


def _nan_outputs(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs[4:] = float("nan")
    return result


def _nan_first_layer_grads(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.grads["a.weight"][0] = float("nan")
    return result


def test_nan_from_the_runner_is_named_with_where_it_first_shows() -> None:
    with pytest.raises(pc.EquivalenceError) as info:
        _check(TwoLayers, runner=_nan_outputs)
    assert ("note: the runner produced NaN where eager has numbers: 16 elements in 1 row (shown as inf errors), "
            "already in the forward: output (stage 1).") in str(info.value)
    with pytest.raises(pc.EquivalenceError) as info:
        _check(TwoLayers, runner=_nan_first_layer_grads)
    assert ("4 elements in 1 row (shown as inf errors), only in the backward (outputs and loss are numbers), "
            "first on stage 0") in str(info.value)
    assert info.value.report.row("grad a.weight").n_nan == 4


def test_a_loss_fn_called_without_a_target_says_to_pass_one() -> None:
    with pytest.raises(pc.LossError, match="no target was given, so loss_fn was called with target=None: "
                                           "pass target="):
        _check(TwoLayers, loss_fn=torch.nn.functional.mse_loss)


# --- the caller's model and inputs, byte for byte ---------------------------------------------------

def _state(model: nn.Module, *values: Any) -> list[Any]:
    """Everything a check could change: every tensor's bytes, grad, requires_grad and version, and
    each module's attributes, mode and hooks."""
    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        grad = None if t.grad is None else t.grad.clone()
        return (t.detach().clone(), t.requires_grad, t._version, grad, t.dtype, t.device)

    tensors = [(name, tensor(t)) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    modules = [(name, m.training, sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks),
                len(m._backward_hooks)) for name, m in model.named_modules()]
    inputs = [tensor(leaf) for leaf in pytree.tree_leaves(values) if isinstance(leaf, torch.Tensor)]
    return [tensors, modules, inputs]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.nan_to_num() if a.is_floating_point() else a, b.nan_to_num() if b.is_floating_point() else b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize(("entry", "style"), [pytest.param(e, s, id=f"{e.name}-{s}") for e, s in fixtures.cases()])
def test_a_check_leaves_a_zoo_model_and_its_inputs_exactly_as_they_were(entry: fixtures.ZooModel,
                                                                        style: str) -> None:
    model = entry.factory(style)()
    args, kwargs = entry.inputs()
    target = entry.target()
    before = _state(model, args, kwargs, target)
    pc.assert_equivalent(model, args, kwargs, runner="reference", loss_fn=entry.loss_fn, target=target,
                         n_microbatches=2, **entry.cut(style))
    assert _same(_state(model, args, kwargs, target), before)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(pst.pipeline_cases())
def test_a_check_leaves_a_generated_model_and_its_inputs_exactly_as_they_were(case: pst.PipelineCase) -> None:
    model = pst.build(case.spec)
    args, kwargs = pst.make_inputs(case.spec)
    kwargs = {name: pc.Replicated(value) if case.spec.input(name).role == "replicated" else value
              for name, value in kwargs.items()}
    before = _state(model, args, kwargs)
    try:
        pc.assert_equivalent(model, args, kwargs, **case.call_arguments("reference"))
    except pc.InputError:  # a generated case pipecheck refuses (e.g. random): nothing must change either
        pass
    assert _same(_state(model, args, kwargs), before)


# --- arguments that are fine ------------------------------------------------------------------------

class AddsAPrefix(TwoLayers):
    def forward(self, x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + prefix.sum()


def test_an_empty_input_beside_a_batch_goes_whole_to_one_micro_batch() -> None:
    assert _check(AddsAPrefix(), (X, torch.zeros(0)), n_microbatches=1).ok


def test_numpy_scalars_are_numbers_like_any_other() -> None:
    report = _check(TwoLayers, seed=np.int64(3), n_microbatches=np.int64(2), timeout=np.float32(30),
                    check_grads=np.bool_(True), tolerance=pc.Tolerance(np.float32(1e-5), np.float32(1e-6)),
                    split_spec=None, policy=pc.policies.balanced_params(np.int64(2)))
    assert report.ok and report.num_stages == 2


def test_checks_leave_no_compiled_source_behind() -> None:
    """torch.fx caches every compiled forward's source for good; a stage module takes its own with it."""
    import gc
    import linecache

    import torch.fx.graph_module as graph_module

    _check(TwoLayers)
    gc.collect()
    before = (len(graph_module._loader.eval_cache), len(linecache.cache))
    for _ in range(5):
        _check(TwoLayers)
        pc.split(TwoLayers(), (X,), split_spec=CUT)
    gc.collect()
    assert (len(graph_module._loader.eval_cache), len(linecache.cache)) == before
