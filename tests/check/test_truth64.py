"""The float64 truth for every op: an op with no float64 kernel is computed by pipecheck's own float64
implementation (torch._grouped_mm) or in float32 inside the truth, its rounding added to the tolerance;
a check through such an op passes a correct runner and still catches a wrong one."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from pipecheck.fixtures import get

import pipecheck as pc
from pipecheck import Job
from pipecheck._check.truth64 import PERTURBATION, _grouped_mm64, float64_truth

# private: the reference runner and the check's prepared inputs, which the truth consumes
from pipecheck._runners.base import run_reference
from pipecheck._split.inputs import prepare_inputs
from pipecheck.losses import projection_loss


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4).transpose(-2, -1),
                          offs=torch.tensor([4], dtype=torch.int32))
    except Exception:
        return False
    return True


GROUPED_MM = pytest.mark.skipif(not hasattr(torch, "_grouped_mm") or not _cpu_grouped_mm(),
                                reason="this torch has no torch._grouped_mm on CPU")


@torch.library.custom_op("pipecheck_test::cube32", mutates_args=())
def cube32(x: torch.Tensor) -> torch.Tensor:
    """x**3 with a float32 kernel only, as a custom op or a fused kernel can be."""
    if x.dtype == torch.float64:
        raise RuntimeError("cube32 is not implemented for 'Double'")
    return x * x * x


@cube32.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _cube_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * 3 * x * x


cube32.register_autograd(_cube_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class Float32Op(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = cube32(self.a(x))
        pc.pipe_split()
        return self.b(h)


class Experts(nn.Module):
    """Two experts over the halves of each micro-batch of 4, through torch._grouped_mm (no float64
    kernel). The group ends are a buffer, so fx traces it on every torch (torch 2.10's export refused
    a float32 grouped_mm: "Expected inputs of BF16 type")."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(2, 16, 8) / 4)  # (group, out, in), applied transposed
        self.out = nn.Linear(16, 4)
        self.register_buffer("offs", torch.tensor([2, 4], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch._grouped_mm(h, self.experts.transpose(-2, -1), offs=self.offs)
        pc.pipe_split()
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "3d2d", "2d2d"])
@GROUPED_MM
def test_the_float64_grouped_mm_is_torch_s_on_every_layout(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)  # an empty group too
    a, b = {"2d3d": (torch.randn(12, 8, generator=g), torch.randn(4, 16, 8, generator=g).transpose(-2, -1)),
            "3d3d": (torch.randn(4, 5, 8, generator=g), torch.randn(4, 16, 8, generator=g).transpose(-2, -1)),
            "3d2d": (torch.randn(4, 5, 8, generator=g), torch.randn(12, 8, generator=g).t()),
            "2d2d": (torch.randn(16, 12, generator=g), torch.randn(8, 12, generator=g).t())}[layout]
    offs_or_none = None if layout == "3d3d" else offs
    expected = torch._grouped_mm(a, b, offs=offs_or_none).double()
    got = _grouped_mm64(a.double(), b.double(), offs=offs_or_none)
    assert got.dtype == torch.float64 and got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@GROUPED_MM
def test_a_grouped_mm_model_is_checked_against_an_exact_float64_truth() -> None:
    report = pc.assert_equivalent(Experts, (torch.randn(8, 8),), runner="reference", n_microbatches=2)
    assert report.ok and report.num_stages == 2
    assert report.power < 1e-4, report.power_text()
    assert any("computes torch.ops.aten._grouped_mm with pipecheck's float64 implementation" in note
               for note in report.notes), report.notes


def _truth(model: nn.Module, x: torch.Tensor) -> Any:
    inputs = prepare_inputs(model, (x,), None, None)
    return float64_truth(model, inputs, projection_loss, torch.randn(8, 4, dtype=torch.float64), 2, True, 0)


def test_an_op_with_float32_kernels_only_runs_in_float32_inside_the_truth_with_its_rounding_measured() -> None:
    torch.manual_seed(0)
    model, x = Float32Op(), torch.randn(8, 8)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    truth = _truth(model, x)
    assert truth.float32_ops == ("torch.ops.pipecheck_test.cube32",) and truth.exact_ops == ()
    assert truth.outputs.dtype == torch.float64 and truth.grads["a.weight"].dtype == torch.float64
    assert all(p.dtype == torch.float32 and torch.equal(p, before[name]) for name, p in model.named_parameters())
    # the truth is off by the op's float32 rounding: the measured error is of that size, not zero, not gross
    moved = truth.error.outputs.max() / truth.outputs.abs().max()
    eps = torch.finfo(torch.float32).eps
    assert 0.1 * eps < moved < 10 * PERTURBATION * eps, moved
    assert truth.error.grads["b.weight"].max() > 0  # b's gradient reads the op's output
    assert truth.error.grads["a.weight"].max() == 0  # a's reads its float64 backward alone: exact
    with torch.no_grad():  # the truth is within float32 rounding of the float64 computation
        expected = model.b.double()(model.a.double()(x.double()) ** 3)
        model.float()
    assert torch.allclose(truth.outputs, expected, rtol=1e-5, atol=1e-6)


def test_a_check_through_a_float32_op_passes_a_correct_runner_and_says_how_the_truth_was_made() -> None:
    report = pc.assert_equivalent(Float32Op, (torch.randn(8, 8),), runner="reference", n_microbatches=2)
    assert report.ok and report.power < 1e-4, report.power_text()
    assert any("runs torch.ops.pipecheck_test.cube32 in float32" in note for note in report.notes), report.notes


def _scaled(factor: float, job: Job) -> pc.StepResult:
    """The reference, with one gradient off by ``factor``: a bug an engine could have."""
    result = run_reference(job)
    result.grads["a.weight"] = result.grads["a.weight"] * factor
    return result


@pytest.mark.parametrize("model", [Float32Op, pytest.param(Experts, marks=GROUPED_MM)])
def test_a_gradient_off_by_a_tenth_of_a_percent_is_caught_through_an_op_without_a_float64_kernel(model: Any) -> None:
    name = "grad a.weight" if model is Float32Op else "grad inp.weight"
    if model is Experts:
        def runner(job: Job) -> pc.StepResult:
            result = run_reference(job)
            result.grads["inp.weight"] = result.grads["inp.weight"] * 1.001
            return result
    else:
        runner = functools.partial(_scaled, 1.001)
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(model, (torch.randn(8, 8),), runner=runner, n_microbatches=2)
    assert [row.name for row in caught.value.report.failures] == [name]


# --- a check in float64: the truth is eager's own float64 step, its rounding estimated from float32 -------------

def _zoo_check(name: str, runner: Any, **settings: Any) -> pc.Report:
    entry = get(name)
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, loss_fn=entry.loss_fn,
                                target=entry.target(), n_microbatches=4, **entry.cut(style), **settings)


def test_a_float64_check_passes_a_correct_runner_that_sums_micro_batches_in_another_order() -> None:
    """Before, the tolerance was float64's floor of 2 epsilons: the reference runner's gradient of a bias
    whose sum cancels was 1.7 epsilons of its scale off, and a correct runner failed."""
    report = _zoo_check("encoder_decoder", "reference", dtype=torch.float64)
    assert report.ok and report.dtype == "float64"
    assert report.power < 1e-12, report.power_text()  # float64 still sees what float64 can


def test_a_float64_truth_carries_its_own_rounding_one_rung_down_the_precision_ladder() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double(), torch.randn(8, 8).double()
    inputs = prepare_inputs(model, (x,), None, None)
    target = torch.randn(8, 4, dtype=torch.float64)
    truth = float64_truth(model, inputs, projection_loss, target, 2, True, 0, torch.float64)
    low = float64_truth(model.float(), prepare_inputs(model, (x.float(),), None, None), projection_loss, target, 2,
                        True, 0, torch.float32)  # the float32 step's distance from float64, measured the same way
    model.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    for name in ("0.weight", "2.weight", "2.bias"):
        error = truth.error.grads[name]
        assert error.max() > 0
        assert error.max() < 2 ** -29 * truth.grads[name].abs().max() * 64  # float32's own error, scaled
    assert low.error is None  # a float32 check measures eager's error directly


def test_a_float64_check_still_sees_a_gradient_off_by_one_part_in_a_million() -> None:
    def off(job: Job) -> pc.StepResult:
        result = run_reference(job)
        name = sorted(result.grads)[0]
        result.grads[name] = result.grads[name] * (1 + 1e-6)
        return result

    with pytest.raises(pc.EquivalenceError) as caught:
        _zoo_check("mlp", off, dtype=torch.float64)
    assert len(caught.value.report.failures) == 1


class Float64Only(nn.Module):
    """Refuses any dtype but float64: float64's rounding cannot be estimated from a float32 run."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            raise TypeError("float64 inputs only")
        h = self.a(x)
        pc.pipe_split()
        return self.b(h)


def test_a_float64_only_model_is_checked_at_float64_s_floor_and_says_so() -> None:
    report = pc.assert_equivalent(Float64Only().double(), (torch.randn(8, 8, dtype=torch.float64),),
                                  runner="reference", n_microbatches=2)
    assert report.ok and report.dtype == "float64"
    assert any(note.startswith("float64's own rounding could not be estimated, the same step in float32 failed")
               and "TypeError: float64 inputs only" in note for note in report.notes), report.notes


# --- review: odd models through the truth ---------------------------------------------------------------------------

@torch.library.custom_op("pipecheck_test::causal_mask32", mutates_args=())
def causal_mask32(scores: torch.Tensor) -> torch.Tensor:
    """Fills the future with finfo(float32).min, float32 kernel only (as fused attention kernels do)."""
    if scores.dtype == torch.float64:
        raise RuntimeError("causal_mask32 is not implemented for 'Double'")
    future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(future, torch.finfo(torch.float32).min)


@causal_mask32.register_fake
def _(scores: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scores)


causal_mask32.register_autograd(
    lambda ctx, grad: grad.masked_fill(torch.ones(grad.shape[-2:], dtype=torch.bool).triu(1), 0.0),
    setup_context=lambda ctx, inputs, output: None)


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 8)
        scores = causal_mask32(self.q(x) @ self.k(x).transpose(-2, -1))
        h = torch.softmax(scores, dim=-1) @ x
        pc.pipe_split()
        return self.out(h)


def test_a_mask_s_fill_value_is_no_scale_for_the_float32_op_s_rounding() -> None:
    """Perturbing by 8 epsilons of finfo.min moved every value: every row was blind (a PowerError)."""
    report = pc.assert_equivalent(MaskedAttention, (torch.randn(4, 6, 8),), runner="reference", n_microbatches=2)
    assert report.ok and report.power < 1e-4, report.power_text()


class FixedDtypeEye(nn.Module):
    """Mixes its input with a float32 tensor it makes itself: the float64 copy's matmul fails."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) @ torch.eye(4)
        pc.pipe_split()
        return self.b(h)


def test_float64_mixed_with_a_tensor_the_model_makes_is_named_as_such() -> None:
    report = pc.assert_equivalent(FixedDtypeEye, (torch.randn(8, 4),), runner="reference", n_microbatches=2)
    assert report.ok and report.power < 1e-4
    note = next(note for note in report.notes if note.startswith("the float64 truth runs"))
    assert "in float32 (float64 mixed there with a float32 tensor the model makes itself)" in note, note


def test_higher_order_ops_pass_through_the_truth_s_and_the_probe_s_dispatch_modes() -> None:
    from pipecheck._check.determinism import _Draws
    from pipecheck._check.truth64 import Float64Ops

    x = torch.randn(3, dtype=torch.float64)
    for mode in (Float64Ops(), _Draws()):
        with mode:
            y = torch.cond(x.sum() > 0, torch.sin, torch.cos, (x,))
        assert torch.equal(y, torch.sin(x) if x.sum() > 0 else torch.cos(x))


def test_a_complex_value_of_a_float64_check_carries_its_rounding_too() -> None:
    import test_numerics

    report = pc.assert_equivalent(test_numerics.ComplexPhase, (torch.randn(8, 4),), runner="reference",
                                  n_microbatches=2, dtype=torch.float64)
    phase = report.row("grad phase")  # complex128, compared as (real, imaginary) pairs
    assert report.ok and phase.eager_off is not None and phase.eager_off > 0  # not float64's floor alone


def test_the_cast_and_back_leaves_parameters_and_their_gradients_the_very_objects_they_were() -> None:
    from pipecheck._check.eager import in_dtype

    model = nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    param, data, grad = model.weight, model.weight.data, model.weight.grad
    before = grad.clone()
    with in_dtype(model, torch.float64) as cast:
        assert cast.weight.dtype == torch.float64
    assert model.weight is param and model.weight.data.data_ptr() == data.data_ptr()
    assert model.weight.grad is grad and grad.dtype == torch.float32 and torch.equal(grad, before)


def cube_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss through the float32-only op: the float64 truth's loss fails as its model would."""
    return cube32(out - target).mean()


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        pc.pipe_split()
        return self.b(h)


def test_a_loss_through_an_op_without_a_float64_kernel_gets_a_truth_too() -> None:
    """The model runs in float64; only the loss fails there (a LossError, retried like the model's)."""
    report = pc.assert_equivalent(Plain, (torch.randn(8, 8),), runner="reference", n_microbatches=2,
                                  loss_fn=cube_loss, target=torch.randn(8, 4))
    assert report.ok and report.power < 1e-4, report.power_text()
    assert any("runs torch.ops.pipecheck_test.cube32 in float32" in note for note in report.notes), report.notes
