"""assert_equivalent catches broken runners, names the tensor, and hints at the cause."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import pipecheck as pc
from pipecheck import fixtures

# private: the reference runner's function, and the stage steps, reused by planted-bug runners
from pipecheck._runners.base import run_reference
from pipecheck._runtime.stage_step import (
    LeafGrads,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    stage_backward,
)

zoo_models = fixtures.models


def _zoo_check(name: str, style: str, runner: Any, n_microbatches: int = 4, **options: Any) -> pc.Report:
    entry = fixtures.get(name)
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, loss_fn=entry.loss_fn,
                                target=entry.target(), n_microbatches=n_microbatches, **entry.cut(style),
                                **options)


def _failure(name: str, style: str, runner: Any, n_microbatches: int = 4,
             **options: Any) -> pc.EquivalenceError:
    with pytest.raises(pc.EquivalenceError) as info:
        _zoo_check(name, style, runner, n_microbatches, **options)
    assert isinstance(info.value, AssertionError)
    assert isinstance(info.value.report, pc.Report)
    return info.value


def _failing(err: pc.EquivalenceError) -> list[str]:
    return [row.name for row in err.report.failures]


# --------------------------------------------------------------------------- broken runners


def tied_grads_from_last_stage_only(job: pc.Job) -> pc.StepResult:
    """Like torch.distributed.pipelining: each replica keeps its own stage's share."""
    result = run_reference(job)
    for group in job.split().tied_groups:
        result.grads[group.fqn] = result.stage_grads[group.stages[-1]][group.fqn]
    return result


class SkipGradDropper(pc.DetachExecutor):
    """Drops the gradient of every value a stage reads from a producer ``min_gap`` or more stages back."""

    min_gap = 2

    def backward_microbatch(self, mb: int, forwards: list[StageForward], loss: torch.Tensor, loss_scale: float,
                            param_grads: list[dict[str, torch.Tensor]], owned: list[set[str]],
                            input_grads: dict[tuple[int, str, int], LeafGrads]) -> None:
        pending: dict[tuple[int, str], LeafGrads] = {}
        for stage in reversed(self.pipe.stages):
            last = stage.index == self.pipe.num_stages - 1
            out_grads = [pending.pop((stage.index, name), None) for name in stage.outputs]
            in_grads, p_grads = stage_backward(stage, forwards[stage.index], out_grads,
                                               loss if last else None, loss_scale)
            add_param_grads(param_grads[stage.index], p_grads, owned[stage.index])
            for src, grads in zip(stage.inputs, in_grads, strict=True):
                if src.stage is None:
                    input_grads[(stage.index, src.name, mb)] = grads
                elif stage.index - src.stage < self.min_gap:  # the bug: a skip's gradient never goes back
                    pending[(src.stage, src.name)] = add_leaf_grads(pending.get((src.stage, src.name)), grads)


class StageInputGradDropper(SkipGradDropper):
    min_gap = 1  # every gradient between stages is lost


def _executor_runner(executor: type[pc.DetachExecutor]) -> Callable[[pc.Job], pc.StepResult]:
    def runner(job: pc.Job) -> pc.StepResult:
        return executor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                          n_microbatches=job.n_microbatches)

    runner.__name__ = executor.__name__
    return runner


def outputs_merged_in_reverse(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = torch.cat(result.outputs.chunk(job.n_microbatches)[::-1])
    return result


def grads_not_averaged(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.grads = {fqn: g * job.n_microbatches for fqn, g in result.grads.items()}
    return result


def grads_averaged_twice(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.grads = {fqn: g / job.n_microbatches for fqn, g in result.grads.items()}
    return result


def targets_reversed_across_microbatches(job: pc.Job) -> pc.StepResult:
    """Micro-batch i's loss is taken against micro-batch n-1-i's target (so its output grads are swapped)."""
    chunks = pc.split_microbatches(job.target, job.n_microbatches, "target")
    return run_reference(dataclasses.replace(job, target=pc.merge_microbatches(chunks[::-1])))


def input_grads_dropped(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.input_grads = {}
    return result


def one_grad_nudged_by_one_ulp(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    grad = result.grads["head.bias"]
    grad[0] = torch.nextafter(grad[0], torch.tensor(float("inf")))
    return result


def output_off_by_1e_3(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = result.outputs + 1e-3
    return result


def outputs_as_a_list(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = [result.outputs]
    return result


# --------------------------------------------------------------------------- each bug is named


def test_tied_weight_gradient_from_one_stage_is_reported_by_name() -> None:
    err = _failure("tiny_gpt", "markers", tied_grads_from_last_stage_only)
    assert _failing(err) == ["grad tok_emb.weight"]
    row = err.report.row("grad tok_emb.weight")
    assert row.stages == (0, 3)
    assert err.report.hints["grad tok_emb.weight"].startswith(
        "tied parameter not synchronised: gradient equals stage 3's share only; stages 0, 3 hold replicas")
    assert "grad tok_emb.weight  0,3" in str(err)
    assert "hint: tied parameter not synchronised" in str(err)


def test_reused_module_gradients_from_one_stage_are_each_reported() -> None:
    err = _failure("alias_reuse", "markers", tied_grads_from_last_stage_only, n_microbatches=1)
    assert _failing(err) == ["grad proj.weight", "grad shared.fc.weight", "grad shared.fc.bias",
                             "grad shared.norm.weight", "grad shared.norm.bias"]
    assert all(h.startswith("tied parameter not synchronised") for h in err.report.hints.values())
    assert set(err.report.hints) == set(_failing(err))


def test_dropped_skip_gradient_fails_exactly_the_producer_stages_parameters() -> None:
    err = _failure("long_skip", "spec", _executor_runner(SkipGradDropper), n_microbatches=2)
    # The skip 0 -> 3 loses its gradient: stage 0's gradients are partial (not zero), stages 1-3 are right.
    assert _failing(err) == ["grad blocks.0.fc.weight", "grad blocks.0.fc.bias", "grad blocks.0.norm.weight",
                             "grad blocks.0.norm.bias"]
    assert {row.stages for row in err.report.failures} == {(0,)}
    assert err.report.row("output").ok and err.report.row("loss").ok
    # The partial gradients match a what-if reference run with the 0 -> 3 gradient dropped.
    assert set(err.report.hints) == set(_failing(err))
    assert all(h.startswith("skip-connection gradient dropped") and "(stage 0 -> stage 3)" in h
               for h in err.report.hints.values())


def test_dropped_encoder_gradient_fails_every_encoder_parameter() -> None:
    err = _failure("encoder_decoder", "spec", _executor_runner(SkipGradDropper), n_microbatches=1)
    failing = _failing(err)
    assert len(failing) == 12 and all(name.startswith("grad encoder.") for name in failing)


STARVED_PARAMS = [f"grad layers.{i}.{p}" for i in range(3)
                  for p in ("fc.weight", "fc.bias", "norm.weight", "norm.bias")]


def test_gradients_that_never_arrive_are_missing_rows() -> None:
    err = _failure("mlp", "markers", _executor_runner(StageInputGradDropper), n_microbatches=2)
    # Only the last stage gets a gradient (from the loss); the reference leaves the others out.
    assert _failing(err) == STARVED_PARAMS
    assert all(row.note == "missing from the runner's result" for row in err.report.failures)


def test_zero_gradients_that_never_arrive_are_hinted() -> None:
    def zero_filled(job: pc.Job) -> pc.StepResult:  # as an engine with zero-initialised .grad reports them
        result = _executor_runner(StageInputGradDropper)(job)
        params = job.build_model().named_parameters()
        result.grads = {fqn: result.grads.get(fqn, torch.zeros_like(p)) for fqn, p in params}
        return result

    err = _failure("mlp", "markers", zero_filled, n_microbatches=2)
    assert _failing(err) == STARVED_PARAMS
    assert set(err.report.hints) == set(STARVED_PARAMS)
    assert all(hint.startswith("gradient is zero: no gradient reached this tensor")
               for hint in err.report.hints.values())


def test_outputs_merged_in_the_wrong_order_are_recognised() -> None:
    err = _failure("mlp", "markers", outputs_merged_in_reverse)
    assert _failing(err) == ["output"]
    assert err.report.hints["output"] == (
        "outputs permuted across micro-batches: merged position <- micro-batch: 0<-3, 1<-2, 2<-1, 3<-0; "
        "merge micro-batch outputs in micro-batch order")


def test_gradients_not_averaged_over_microbatches_are_recognised() -> None:
    err = _failure("mlp", "markers", grads_not_averaged)
    assert len(_failing(err)) == 18 and all(name.startswith("grad ") for name in _failing(err))
    for name in _failing(err):
        assert err.report.hints[name].startswith(
            "gradient scaling: gradient is n_microbatches (=4) times too large")


def test_gradients_averaged_twice_are_recognised() -> None:
    err = _failure("mlp", "markers", grads_averaged_twice)
    assert err.report.hints["grad head.weight"].startswith(
        "gradient scaling: gradient is n_microbatches (=4) times too small")


# --------------------------------------------------------------------------- the default loss


def test_default_loss_catches_gradients_from_the_wrong_microbatch() -> None:
    err = _failure("mlp", "markers", targets_reversed_across_microbatches)
    assert "loss" in _failing(err)
    assert "grad head.weight" in _failing(err)
    assert err.report.row("output").ok


def test_a_sum_like_loss_is_blind_to_the_same_bug() -> None:
    # Why the default is a random projection and not .sum(): all-ones weights hide the permutation.
    entry = fixtures.get("mlp")
    args, _ = entry.inputs()
    report = pc.assert_equivalent(entry.factory("markers"), args, runner=targets_reversed_across_microbatches,
                                  loss_fn=lambda out, w: (out * w).sum(), target=torch.ones(8, 4),
                                  n_microbatches=4)
    assert report.ok


# --------------------------------------------------------------------------- golden failure report


class TiedPair(nn.Module):
    """Integer weights and inputs in float64: every number in the report is exact on any machine."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 2, bias=False)
        self.mid = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
            self.mid.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        pc.pipe_split()
        return F.linear(self.mid(h), self.emb.weight)


def tied_unsynced_and_outputs_reversed(job: pc.Job) -> pc.StepResult:
    result = tied_grads_from_last_stage_only(job)
    result.outputs = torch.cat(result.outputs.chunk(job.n_microbatches)[::-1])
    return result


def test_failure_report_text() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]])
    target = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 1.0], [-1.0, 3.0]])
    with pytest.raises(pc.EquivalenceError) as info:
        pc.assert_equivalent(TiedPair, (x,), runner=tied_unsynced_and_outputs_reversed,
                             loss_fn=lambda out, t: (out * t).sum(), target=target, n_microbatches=2,
                             dtype=torch.float64)
    assert_expected_inline(str(info.value), """\
pipecheck: runner 'tied_unsynced_and_outputs_reversed' does not match eager (2 of 4 tensors fail; tolerance auto, float64, 2 stages split by fx, 2 micro-batches)
no boundary value diverges (14 values the stages received and sent, forward and backward, match the reference): the outputs or the loss are wrong although the last stage computed them right: the bug is in how the engine merges the micro-batches' outputs or computes the loss from them; and the bug is in how the engine handles gradients after computing them (accumulation, scaling, reduction, tied replicas), not in its dataflow

tensor           stage  shape   max abs   max rel   tolerance                        worst index  failing
---------------  -----  ------  --------  --------  -------------------------------  -----------  -------------
output           1      (4, 2)  1.00e+01  5.00e+00  auto: atol 4.9e-15 rtol 4.4e-16  (1, 0)       8/8 in mb 0,1
  hint: outputs permuted across micro-batches: merged position <- micro-batch: 0<-1, 1<-0; merge micro-batch outputs in micro-batch order
grad emb.weight  0,1    (2, 2)  3.50e+00  1.00e+00  auto: atol 3.3e-15 rtol 4.4e-16  (0, 1)       4/4
  hint: tied parameter not synchronised: gradient equals stage 1's share only; stages 0, 1 hold replicas and their gradients must be summed (all-reduce)""")


# --------------------------------------------------------------------------- other checks


class LogOfNegative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pc.pipe_split()
        return torch.log(self.b(h))  # some elements are negative: NaN


class MaskedPadding(nn.Module):
    """Logits of padded vocabulary masked with -inf: an infinite output, a finite loss and gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 6)
        self.register_buffer("pad", torch.tensor([0.0, 0.0, 0.0, 0.0, float("-inf"), float("-inf")]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        pc.pipe_split()
        return self.b(h) + self.pad


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def test_an_infinite_output_with_a_finite_loss_is_compared_not_refused() -> None:
    x, target = torch.randn(8, 4), torch.randint(0, 4, (8,))
    report = pc.assert_equivalent(MaskedPadding, (x,), runner="reference", n_microbatches=2, loss_fn=_cross_entropy,
                                  target=target)
    assert report.row("output").ok and report.row("grad b.weight").ok
    err = _failure_of(MaskedPadding, x, _cross_entropy, target)
    assert _failing(err) == ["output"]  # a runner that loses the mask still fails on it


def _unmasked(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = torch.nan_to_num(result.outputs, neginf=-1e4)
    return result


def _failure_of(model: Any, x: torch.Tensor, loss_fn: Any, target: torch.Tensor) -> pc.EquivalenceError:
    with pytest.raises(pc.EquivalenceError) as info:
        pc.assert_equivalent(model, (x,), runner=_unmasked, n_microbatches=2, loss_fn=loss_fn, target=target)
    return info.value


def test_nan_in_the_eager_model_is_a_nonfinite_error_not_a_mismatch() -> None:
    with pytest.raises(pc.NonFiniteError) as info:
        pc.assert_equivalent(LogOfNegative, (torch.randn(8, 4),), runner="reference")
    assert not isinstance(info.value, pc.EquivalenceError)
    assert "the eager model itself produced NaN/Inf in: output, loss" in str(info.value)


class TrainModeDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.a(x))
        pc.pipe_split()
        return self.b(h)


def outputs_scaled_by_1_3(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = result.outputs * 1.3
    return result


def test_a_stochastic_eager_model_is_refused_instead_of_widening_the_auto_tolerance() -> None:
    """Dropout in train mode: eager disagrees with its own fp64 copy by O(1), which would become
    the atol; under a runner that does not follow pipecheck's randomness contract the check refuses the
    model instead, naming the contract as the fix (docs/randomness.md)."""
    with pytest.raises(pc.InputError, match=r"draws random numbers in train mode \(stage 0: drop \(Dropout\)\), and "
                                            r"runner 'outputs_scaled_by_1_3' does not say it follows pipecheck's "
                                            r"randomness contract.*model\.eval\(\) checks the deterministic model only"):
        pc.assert_equivalent(TrainModeDropout, (torch.randn(8, 4),), runner=outputs_scaled_by_1_3,
                             n_microbatches=2)


class OwnGeneratorMask(nn.Module):
    """Random without touching torch's global RNG: a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.g = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * (torch.rand(h.shape, generator=self.g) > 0.5)
        pc.pipe_split()
        return self.b(h)


class CallCounter(nn.Module):
    """Different on every call, with no RNG at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x) * (1 + self.calls % 3)
        pc.pipe_split()
        return self.b(h)


@pytest.mark.parametrize("model", [OwnGeneratorMask, CallCounter])
def test_randomness_outside_the_global_rng_is_refused_too(model: type[nn.Module]) -> None:
    """The probe does not wait for torch's RNG state to move: a wrong runner must never pass
    because the model's own spread widened the auto tolerance."""
    with pytest.raises(pc.InputError, match=r"not deterministic.*model\.eval\(\)"):
        pc.assert_equivalent(model(), (torch.randn(8, 4),), runner=outputs_scaled_by_1_3, n_microbatches=2)


class Untraceable(nn.Module):
    """Python logic on a tensor's value: neither fx nor export follows it."""

    def __init__(self, random: bool) -> None:
        super().__init__()
        self.a, self.b, self.random = nn.Linear(4, 4), nn.Linear(4, 4), random

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if float(h.detach().sum()) > -1e9:
            h = h * (torch.rand_like(h) > 0.5) if self.random else h * 0.5
        pc.pipe_split()
        return self.b(h)


def test_a_random_model_no_tracer_can_trace_is_refused_as_random() -> None:
    """The reason that matters first: no split of a random model could match it (torch < 2.13 cannot
    trace a model's own Generator, so OwnGeneratorMask takes this path there)."""
    with pytest.raises(pc.InputError, match=r"not deterministic.*no tracer could trace it \(neither tracer could "
                                            r"trace Untraceable.*Fix: make forward traceable"):
        pc.assert_equivalent(Untraceable(random=True), (torch.randn(8, 4),), runner="reference", n_microbatches=2)
    with pytest.raises(pc.TraceError, match="neither tracer could trace Untraceable"):
        pc.assert_equivalent(Untraceable(random=False), (torch.randn(8, 4),), runner="reference", n_microbatches=2)


def test_the_probe_tolerates_last_bit_differences_but_not_random_ones() -> None:
    """Atomic adds on a GPU reorder sums from call to call; dropout changes values wholesale."""
    from pipecheck._check.determinism import _differ

    a = torch.randn(64, 64)
    assert not _differ(a, a.clone())
    assert not _differ(a, a + a.abs() * torch.finfo(a.dtype).eps * 4)
    assert _differ(a, a * (torch.rand_like(a) > 0.1))
    assert _differ(torch.arange(4), torch.arange(4).flip(0))
    assert not _differ(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))


@pytest.mark.parametrize("options,message", [
    ({"dtype": "float32"}, r"dtype='float32' is not a floating-point torch.dtype\. Fix: .*torch\.float32"),
    ({"dtype": torch.int64}, r"dtype=torch.int64 is not a floating-point torch.dtype"),
    ({"device": "tpu"}, r"device='tpu' is not a torch device .*Fix: pass 'cpu', 'cuda'"),
    pytest.param({"device": "cuda"}, r"CUDA is not available here .*Fix: device='cpu'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_a_bad_dtype_or_device_is_an_input_error_naming_the_fix(options: dict[str, Any], message: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(pc.InputError, match=message):
        pc.assert_equivalent(model, (torch.randn(8, 4),), runner="reference", **options)


def test_exact_tolerance_passes_the_reference_runner_with_one_microbatch() -> None:
    report = _zoo_check("mlp", "markers", "reference", n_microbatches=1, tolerance="exact")
    assert report.tolerance == "exact"
    assert all(row.max_abs == 0 for row in report.rows)


def test_exact_tolerance_catches_a_one_ulp_difference() -> None:
    err = _failure("mlp", "markers", one_grad_nudged_by_one_ulp, n_microbatches=1, tolerance="exact")
    assert _failing(err) == ["grad head.bias"]
    row = err.report.row("grad head.bias")
    assert (row.tolerance, row.n_failing, row.worst_index) == ("exact", 1, (0,))
    _zoo_check("mlp", "markers", one_grad_nudged_by_one_ulp, n_microbatches=1, tolerance="auto")


def test_explicit_tolerance_is_used_and_shown() -> None:
    loose = pc.Tolerance(rtol=1e-2, atol=1e-2)
    report = _zoo_check("mlp", "markers", output_off_by_1e_3, tolerance=loose)
    assert report.row("output").tolerance == "rtol 1.0e-02 atol 1.0e-02"
    err = _failure("mlp", "markers", output_off_by_1e_3, tolerance=pc.Tolerance(rtol=1e-4, atol=1e-5))
    assert _failing(err) == ["output"]
    assert err.report.row("output").n_failing == 32
    assert "rtol 1.0e-04 atol 1.0e-05" in str(err)


def test_auto_tolerance_catches_a_small_output_error() -> None:
    err = _failure("mlp", "markers", output_off_by_1e_3)
    assert _failing(err) == ["output"]


def test_float16_inputs_and_model_work() -> None:
    report = _zoo_check("mlp", "markers", "reference", dtype=torch.float16)
    assert report.dtype == "float16"
    assert report.ok


def test_outputs_with_the_wrong_structure_are_missing() -> None:
    err = _failure("mlp", "markers", outputs_as_a_list)
    assert _failing(err) == ["output", "output[0]"]
    assert "missing from the runner's result" in str(err)
    assert err.report.hints["output"] == "output structure differs: the runner returned ['output[0]']"
    assert err.report.row("output[0]").note == "not an output of the eager model"


def _dict_outputs_reordered(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.outputs = dict(reversed(list(result.outputs.items())))  # same keys, other order
    result.outputs["extra"] = list(result.outputs["extra"])  # a list where eager has a tuple
    return result


def test_outputs_are_matched_by_key_path_not_container_order() -> None:
    assert _zoo_check("dict_outputs", "markers", _dict_outputs_reordered, n_microbatches=2).ok


def _gradient_for_an_unused_parameter(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.grads["layers.0.fc.weight_renamed"] = torch.ones(3)
    return result


def test_a_gradient_eager_does_not_have_fails_unless_zero() -> None:
    err = _failure("mlp", "markers", _gradient_for_an_unused_parameter)
    assert _failing(err) == ["grad layers.0.fc.weight_renamed"]
    assert err.report.hints["grad layers.0.fc.weight_renamed"].startswith("eager computes no gradient here")


def _gradient_for_an_input_that_needs_none(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.input_grads["x"] = torch.ones(8, 4)
    return result


def test_an_input_gradient_eager_does_not_have_is_named_as_an_input_read_by_its_stage() -> None:
    err = _failure("skip_one", "markers", _gradient_for_an_input_that_needs_none)
    row = err.report.row("grad input x")
    assert _failing(err) == ["grad input x"] and row.stages == (0,) and row.tolerance == "zero expected"
    assert err.report.hints["grad input x"].startswith("eager computes no gradient for this input")


# --------------------------------------------------------------------------- input gradients


def _kwarg_last_inputs_requiring_grad() -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    args, kwargs = fixtures.get("kwarg_last").inputs()
    return (args[0].requires_grad_(),), {"bias": kwargs["bias"].requires_grad_()}


def test_input_gradients_are_compared_when_inputs_require_grad() -> None:
    args, kwargs = _kwarg_last_inputs_requiring_grad()
    report = pc.assert_equivalent(zoo_models.KwargLast, args, kwargs, runner="reference", n_microbatches=4)
    assert report.row("grad input x").stages == (0,)
    assert report.row("grad input bias").stages == (2,)
    assert report.row("grad input bias").shape == (8, 16)
    assert args[0].grad is None and kwargs["bias"].grad is None


def test_input_gradients_are_not_compared_when_inputs_do_not_require_grad() -> None:
    report = _zoo_check("kwarg_last", "markers", "reference")
    assert not [row for row in report.rows if row.name.startswith("grad input")]


def test_a_runner_that_drops_input_gradients_fails() -> None:
    args, kwargs = _kwarg_last_inputs_requiring_grad()
    with pytest.raises(pc.EquivalenceError) as info:
        pc.assert_equivalent(zoo_models.KwargLast, args, kwargs, runner=input_grads_dropped, n_microbatches=4)
    assert [row.name for row in info.value.report.failures] == ["grad input x", "grad input bias"]
    assert "missing from the runner's result" in str(info.value)


# --------------------------------------------------------------------------- the report on success


def test_report_on_success_has_a_row_for_every_output_the_loss_and_every_parameter() -> None:
    entry = fixtures.get("dict_outputs")
    report = _zoo_check("dict_outputs", "markers", "reference")
    names = [row.name for row in report.rows]
    params = [f"grad {fqn}" for fqn, _ in entry.factory("markers")().named_parameters()]
    assert names == ["output['logits']", "output['extra'][0]", "output['extra'][1][0]", "loss", *params]
    assert report.row("output['extra'][0]").stages == (1,)
    assert report.row("output['logits']").stages == (2,)
    assert report.ok and not report.failures
    zero = sum(row.numerically_zero for row in report.rows)
    assert report.headline() == (f"pipecheck: runner 'reference' matches eager ({len(names)} tensors; "
                                 f"can see errors >= 0.001% on every row but {zero} numerically zero; "
                                 "tolerance auto, float32, 3 stages split by fx, 4 micro-batches)")
    assert set(report.timings) >= {"build_s", "split_s", "eager_s", "fp64_s", "runner_s", "compare_s", "total_s"}


def test_report_lists_tied_parameters_once_with_every_stage() -> None:
    report = _zoo_check("tiny_gpt", "markers", "reference", n_microbatches=1)
    names = [row.name for row in report.rows]
    assert names.count("grad tok_emb.weight") == 1 and "grad lm_head.weight" not in names
    assert report.row("grad tok_emb.weight").stages == (0, 3)


def test_check_grads_false_compares_outputs_and_loss_only() -> None:
    report = _zoo_check("mlp", "markers", grads_not_averaged, check_grads=False)
    assert [row.name for row in report.rows] == ["output", "loss"]


class Doubling(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        h = self.a(x)
        pc.pipe_split()
        y = self.b(h)
        return y * 2 if double else y


def test_a_non_tensor_argument_other_than_the_traced_one_is_refused() -> None:
    x = torch.randn(8, 4)
    pipe = pc.split(Doubling(), (x,), {"double": True})
    with pytest.raises(pc.InputError, match=r"double=False, traced with double=True"):
        pc.DetachExecutor(pipe).step((x,), {"double": False})


class WritesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.a(x)
        pc.pipe_split()
        return self.b(h)


def test_a_forward_that_writes_into_its_input_never_touches_the_users_tensor() -> None:
    x = torch.randn(8, 4)
    before = x.clone()
    assert pc.assert_equivalent(WritesItsInput, (x,), runner="reference").ok
    assert torch.equal(x, before)


class NoFloat64Kernel(nn.Module):
    """Runs in float32; its own code refuses float64 (no op pipecheck could run in float32 instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        pc.pipe_split()
        return self.b(h)


def test_a_model_that_refuses_float64_is_named_as_the_ground_truth_s_failure_not_the_model_s() -> None:
    with pytest.raises(pc.InputError) as caught:
        pc.assert_equivalent(NoFloat64Kernel(), (torch.randn(8, 4),), runner="reference", n_microbatches=2)
    message = str(caught.value)
    assert message.startswith("the float64 copy of NoFloat64Kernel (pipecheck's ground truth) failed where the "
                              "model itself ran in its own dtype: the eager model failed on one micro-batch")
    assert "got Double" in message and "the model's own code refuses float64" in message
    assert "experts_implementation='batched_mm'" in message


def test_an_untraceable_model_whose_forward_fails_keeps_its_trace_error() -> None:
    class FailsAndUntraceable(Untraceable):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float(x.detach().sum()) > -1e9:
                raise ValueError("the model's own bug")
            return x

    with pytest.raises(pc.TraceError, match="neither tracer could trace FailsAndUntraceable"):
        pc.assert_equivalent(FailsAndUntraceable(random=False), (torch.randn(8, 4),), runner="reference",
                             n_microbatches=2)


def test_a_runner_s_check_split_refuses_the_split_before_any_eager_work() -> None:
    """The Runner protocol's early refusal: ``check_split(pipe)`` runs on the check's split before the
    eager step (so a split the engine cannot run costs no eager, float64 or runner time)."""
    losses: list[int] = []

    def counted_loss(out: torch.Tensor, target: Any) -> torch.Tensor:
        losses.append(1)
        return out.sum()

    class RefusesTwoStages:
        __name__ = "refuses_two_stages"

        def check_split(self, pipe: pc.Pipe) -> None:
            raise pc.InputError(f"{pipe.num_stages} stages: refused")

        def __call__(self, job: pc.Job) -> pc.StepResult:
            raise AssertionError("a refused split never reaches the runner")

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(pc.InputError, match="2 stages: refused"):
        pc.assert_equivalent(model, (torch.randn(8, 4),), split_spec={"2": pc.SplitPoint.BEGINNING},
                             loss_fn=counted_loss, runner=RefusesTwoStages(), n_microbatches=2)
    assert losses == []
    assert pc.assert_equivalent(model, (torch.randn(8, 4),), split_spec={"2": pc.SplitPoint.BEGINNING},
                                loss_fn=counted_loss, runner="reference", n_microbatches=2).ok
    assert losses  # the same check without the refusal computes losses
