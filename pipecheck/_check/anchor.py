"""What a low-precision check's "auto" tolerance is anchored on, and each tensor's legitimate noise.

    tolerance, notes = eager_anchor(model, inputs, job, eager, result, truth, seed, check_grads)
    tolerance.noise_of("grad fc.weight")   # an EagerAnchored tolerance: Noise(largest=..., norm=...)
    notes                                  # what the report says of it ("auto" and why, where it falls back)

In bfloat16 and float16, eager is 2-40% off float64 on cancelling losses, norm weights and routers, so
a tolerance that grows with that distance grows wider than the bugs. A correct runner is much closer
to eager in eager's own dtype: its forward runs the same kernels on the same micro-batches, bit for
bit, and its gradients differ only by the order their sums are taken in. So while the runner's
outputs are bit for bit eager's (and its loss is eager's, or eager's micro-batch losses summed another
way engines sum them, told by its bits), each tensor is compared with eager, its tolerance measured
from legitimate re-orderings of the same math (the variants):

- eager's own per-micro-batch gradients, summed first to last, last to first, pairwise, and in
  float32 (then rounded to the check's dtype);
- pipecheck's reference runner as it is, with every sum taken in reverse (micro-batches, a skip
  connection's consumers, a tied parameter's replicas, a model input's consumers), accumulating in
  float32, dividing by the micro-batch count after summing (torch's pipelining), and on another number
  of threads (on the CPU a kernel's reduction is split by thread).

A variant of the reference runner widens a tolerance only if it is sound: its forward bit for bit
eager's, and, where it moves a tensor further than the variants before it, the same reference run in
float64 within a sixteenth of the row's epsilon of the float64 truth (a bug of pipecheck's own that
moved a gradient would otherwise widen the tolerance that should catch it). Where the runner's forward
is not bit for bit eager's (an engine's own kernels, a fused op, a GPU kernel chosen by the
micro-batch's shape), the check says so and falls back on the float64 anchor, refusals and all. A
training check (:func:`training_anchor`) measures each step's noise from eager trained again with its
micro-batch gradients summed in other orders.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._check.eager import microbatch_shares, named_tensors, output_name, result_dtype
from pipecheck._check.numerics import (
    EagerAnchored,
    Noise,
    ToleranceLike,
    largest_by_kind,
    numerically_zero,
)
from pipecheck._check.train_eager import Summation, train_eager
from pipecheck._check.truth64 import Float64Ops
from pipecheck._core.precision import PLAIN, Precision
from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job
from pipecheck._runtime.reference import Accumulation, DetachExecutor
from pipecheck._split.checkpoints import regions_of
from pipecheck._split.inputs import Inputs, cast_inputs, cast_module
from pipecheck._split.model_factory import seeded
from pipecheck._split.pipe import Pipe
from pipecheck.errors import first_line, plural
from pipecheck.losses import projection_loss

LOW_PRECISION = (torch.bfloat16, torch.float16)
GUARD = 1 / 16  # of the check's epsilon times a tensor's largest true value: a sound reference is this close


def low_precision(eager: StepResult, precision: Precision = PLAIN) -> bool:
    """Whether a check computes in bfloat16 or float16 (its outputs' dtype, or autocast's)."""
    return _compute_dtype(eager, precision) in LOW_PRECISION


def _compute_dtype(eager: StepResult, precision: Precision) -> torch.dtype:
    return precision.autocast or result_dtype(eager)


def eager_anchor(model: nn.Module, inputs: Inputs, job: Job, eager: StepResult, result: StepResult,
                 truth: StepResult, seed: int, check_grads: bool) -> tuple[ToleranceLike, list[str]]:
    """Tolerance "auto" of a low-precision check whose runner gave ``result``: anchored on eager
    (:class:`EagerAnchored`) or, where the runner's forward is not bit for bit eager's, on float64
    ("auto"); and what the report says of it (see the module's docstring). ``model`` is the check's
    own, as the eager step ran it (its buffers left as found); ``job`` holds the loss and target every
    run used."""
    precision = job.precision
    dtype = _compute_dtype(eager, precision)
    named = str(dtype).removeprefix("torch.") + (" under autocast" if precision.autocast is not None else "")
    differs = forward_difference(result, eager)
    loss = result.loss.to(eager.loss.dtype) if isinstance(result.loss, torch.Tensor) and isinstance(
        eager.loss, torch.Tensor) and result.loss.is_floating_point() else result.loss  # a float32 report of it
    loss_differs = not _same_bits(loss, eager.loss)
    if not differs and loss_differs and (job.n_microbatches == 1 or not check_grads):
        differs = "loss differs"  # one micro-batch's loss, or no per-micro-batch losses to tell its sum by
    if differs:
        return "auto", [f"the runner's forward is not bit for bit eager's ({differs}): this {named} check is "
                        "anchored on float64, whose tolerance grows with eager's own error and may refuse tensors "
                        "as blind (an engine's own kernels, a fused op, or a GPU kernel chosen by the "
                        "micro-batch's shape give this)"]
    notes: list[str] = []
    zero = _numerically_zero(eager, truth)
    if not check_grads:
        return EagerAnchored({}, named, zero), notes
    own: list[StepResult] = []
    expected: dict[str, torch.Tensor] = {}
    if job.n_microbatches > 1:
        with seeded(seed):
            shares, losses = microbatch_shares(model, inputs.unspoiled(), job.loss_fn or projection_loss,
                                               job.target, job.n_microbatches, precision)
        own = [StepResult(None, None, grads) for grads in _share_sums(shares, precision.grad_accumulation)]
        if loss_differs and isinstance(loss, torch.Tensor):
            sums = _loss_sums(losses)
            how = next((how for how, total in sums.items() if _same_bits(loss, total)), "")
            if not how:
                return "auto", [f"the runner's loss is not eager's bits, nor the micro-batches' losses summed any way "
                                f"engines sum them: this {named} check is anchored on float64, whose tolerance grows "
                                "with eager's own error and may refuse tensors as blind"]
            expected["loss"] = sums[how]  # told by its bits: compared with that sum, not widened
            notes.append(f"the runner's loss is eager's micro-batch losses {how}, not their mean: compared with that")
    noise = _noise(eager, own)
    vouched: dict[Accumulation, tuple[set[str], set[str]]] = {}  # per re-ordering: rows found sound, unsound
    for accumulation, variant in _reference_variants(job, eager, seed, notes):
        found = _noise(eager, [variant])
        sound, unsound = vouched.setdefault(accumulation, (set(), set()))
        wider = {name for name, deviation in found.items() if name not in sound | unsound
                 and (noise.get(name, Noise()) | deviation) != noise.get(name, Noise())}
        if wider:  # this re-ordering would widen them: only if pipecheck's own run of it is sound
            bad, said = _unsound_in_float64(job, eager, truth, accumulation, wider, dtype, seed)
            notes += [said] if said else []
            unsound |= bad
            sound |= wider - bad
        for name, deviation in found.items():
            if name not in unsound:
                noise[name] = noise.get(name, Noise()) | deviation
    return EagerAnchored(noise, named, zero, expected), notes


def _numerically_zero(eager: StepResult, truth: StepResult) -> frozenset[str]:
    """The rows whose true value eager cannot resolve (:func:`pipecheck._check.numerics.numerically_zero`)."""
    return _zero_of(_named(eager), _named(truth))


def _zero_of(eager: list[tuple[str, str, Any]], truth: list[tuple[str, str, Any]]) -> frozenset[str]:
    measured: dict[str, tuple[str, float, float | None]] = {}
    truths = {name: value for name, _, value in truth}
    for name, kind, value in eager:
        true = truths.get(name)
        if not (isinstance(value, torch.Tensor) and isinstance(true, torch.Tensor) and value.is_floating_point()
                and value.shape == true.shape and value.numel()):
            continue
        a, b = value.detach().double(), true.detach().double().to(value.device)
        finite = torch.isfinite(a) & torch.isfinite(b)
        scale, off = torch.stack([torch.where(finite, b.abs(), 0.0).max(),
                                  torch.where(finite, (a - b).abs(), 0.0).max()]).tolist()
        measured[name] = (kind, scale, off / scale if scale > 0 else None)
    largest = largest_by_kind((kind, scale) for kind, scale, _ in measured.values())
    return frozenset(name for name, (kind, scale, off) in measured.items()
                     if numerically_zero(kind, scale, off, largest))


def _named(result: StepResult) -> list[tuple[str, str, Any]]:
    """Every compared value of a step by row name, with its kind."""
    return ([(name, "outputs" if name != "loss" else "loss", value) for name, value in named_tensors(result)
             if not name.startswith("grad ")]
            + [(name, "grads", value) for name, value in named_tensors(result) if name.startswith("grad ")]
            + [(f"buffer {fqn}", "buffers", value) for fqn, value in result.buffers.items()])


def forward_difference(result: StepResult, eager: StepResult) -> str:
    """How the runner's outputs differ from eager's bits ("" where they are the same). The loss is
    their micro-batches' losses summed: an engine may sum them its own way (DeepSpeed adds them one
    by one in bfloat16, then divides), which :func:`eager_anchor` tells by its bits."""
    got = {output_name(path): leaf for path, leaf in pytree.tree_flatten_with_path(result.outputs)[0]}
    pairs = [(output_name(path), got.get(output_name(path)), leaf)
             for path, leaf in pytree.tree_flatten_with_path(eager.outputs)[0]]
    return next((f"{name} {differs}" for name, test, expected in pairs for differs in [_bits_differ(test, expected)]
                 if differs), "")


def _bits_differ(test: Any, expected: Any) -> str:
    """How ``test`` differs from ``expected``'s bits, in words ("" where it does not; NaN is NaN)."""
    if not isinstance(expected, torch.Tensor):
        return ""
    if not isinstance(test, torch.Tensor) or test.shape != expected.shape or test.dtype != expected.dtype:
        return f"is not a {tuple(expected.shape)} {expected.dtype} tensor"
    test = test.to(expected.device)  # a World's runner hands back host tensors
    same = (test == expected) | (test.isnan() & expected.isnan()) if test.is_floating_point() else test == expected
    if bool(same.all()):
        return ""
    return f"differs in {plural(int((~same).sum()), 'element')} of {expected.numel()}"


def _same_bits(test: Any, expected: Any) -> bool:
    return not _bits_differ(test, expected)


def _loss_sums(losses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's loss from its micro-batches' own, as engines sum them, by how (eager's is their mean)."""
    n = len(losses)
    return {"added one by one, then divided": _in_order(losses) / n,
            "added last first, then divided": _in_order(losses[::-1]) / n,
            "each divided, then added": _in_order([loss / n for loss in losses]),
            "added in float32, then divided": (_in_order([loss.float() for loss in losses]) / n).to(losses[0])}


def _share_sums(shares: list[dict[str, torch.Tensor]], accumulation: torch.dtype | None
                ) -> list[dict[str, torch.Tensor]]:
    """The micro-batches' own gradients summed first to last, last to first, pairwise, and in float32
    (rounded back to their dtype); with an ``accumulation`` dtype, the first three in it alone."""
    names = list(dict.fromkeys(name for share in shares for name in share))  # a micro-batch without one adds 0

    def summed(order: Callable[[list[torch.Tensor]], torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: order([share[name] if accumulation is None else share[name].to(accumulation)
                             for share in shares if name in share]) for name in names}

    sums = [summed(_in_order), summed(lambda ts: _in_order(ts[::-1])), summed(_pairwise)]
    if accumulation is None:
        sums.append(summed(lambda ts: _in_order([t.float() for t in ts]).to(ts[0].dtype)))
    return sums


def _in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def _pairwise(tensors: list[torch.Tensor]) -> torch.Tensor:
    while len(tensors) > 1:
        tensors = [tensors[i] + tensors[i + 1] if i + 1 < len(tensors) else tensors[i]
                   for i in range(0, len(tensors), 2)]
    return tensors[0]


def accumulations(precision: Precision) -> tuple[Accumulation, ...]:
    """The reference's re-orderings: as it is, reversed, accumulating in float32, and dividing by the
    micro-batch count after summing (torch's pipelining); with a ``grad_accumulation`` dtype, all in it."""
    if precision.grad_accumulation is not None:
        return (Accumulation(dtype=precision.grad_accumulation), Accumulation(True, precision.grad_accumulation),
                Accumulation(dtype=precision.grad_accumulation, scale_after=True))
    return (Accumulation(), Accumulation(reverse=True), Accumulation(dtype=torch.float32),
            Accumulation(scale_after=True))


def _reference_variants(job: Job, eager: StepResult, seed: int, notes: list[str]
                        ) -> Iterator[tuple[Accumulation, StepResult]]:
    """The reference runner's step under each of :func:`accumulations`, and as it is on another number of
    threads (on the CPU a kernel's reduction, a LayerNorm weight's gradient, is split by thread: ranks run
    on fewer), gradients in eager's dtype. None when its forward is not bit for bit eager's, and not the
    other thread count's where its forward is not (a note says so). Each on its own copy of the inputs
    (a forward may write into them), seeded as eager was."""
    threads = torch.get_num_threads()
    runs = [(accumulation, threads) for accumulation in accumulations(job.precision)]
    if eager.loss is not None and eager.loss.device.type == "cpu":
        runs.append((runs[0][0], 1 if threads > 1 else 2))
    for accumulation, count in runs:
        args, kwargs, target = cast_inputs((job.args, job.kwargs, job.target), None, None, copy=True)
        with intra_op_threads(count), seeded(seed):
            step = DetachExecutor(job.split(), accumulation=accumulation, precision=job.precision).step(
                args, kwargs, loss_fn=job.loss_fn, target=target, n_microbatches=job.n_microbatches)
        differs = forward_difference(step, eager)
        if differs:
            on = f" on {plural(count, 'thread')}" if count != threads else ""
            notes.append(f"pipecheck's reference runner's forward{on} is not bit for bit eager's ({differs}): its "
                         "re-orderings there do not set the tolerances")
            continue
        like = {name: grad.to(eager.grads[name].dtype) for name, grad in step.grads.items() if name in eager.grads}
        yield accumulation, StepResult(None, None, like, step.input_grads, step.buffers)


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block."""
    kept = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(kept)


def _noise(eager: StepResult, variants: Iterable[StepResult]) -> dict[str, Noise]:
    """Each gradient's, input gradient's and buffer's noise: the largest deviation of a variant from eager."""
    noise: dict[str, Noise] = {}
    for variant in variants:
        for prefix, mine, theirs in (("grad ", eager.grads, variant.grads),
                                     ("grad input ", eager.input_grads, variant.input_grads),
                                     ("buffer ", eager.buffers, variant.buffers)):
            for key, value in theirs.items():
                expected = mine.get(key)
                if isinstance(expected, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and value.shape == expected.shape and expected.is_floating_point():
                    name = prefix + key
                    noise[name] = noise.get(name, Noise()) | _deviation(value, expected)
    return noise


def _deviation(value: torch.Tensor, expected: torch.Tensor) -> Noise:
    """How far ``value`` is from ``expected``: largest elementwise, and as a norm relative to its norm."""
    a, b = value.detach().double(), expected.detach().double().to(value.device)
    finite = torch.isfinite(a) & torch.isfinite(b)
    diff = torch.where(finite, a - b, 0.0)
    if not diff.numel():
        return Noise()
    scale = torch.where(finite, b, 0.0).norm()
    largest, norm, scale = torch.stack([diff.abs().max(), diff.norm(), scale]).tolist()
    return Noise(largest, norm / scale if scale > 0 else 0.0)


def _unsound_in_float64(job: Job, eager: StepResult, truth: StepResult, accumulation: Accumulation,
                        names: set[str], dtype: torch.dtype, seed: int) -> tuple[set[str], str]:
    """Of the rows ``names``, those where the reference runner, summing as ``accumulation`` says, run in
    float64 is further than GUARD of the row's epsilon (its eager value's dtype's, at most ``dtype``'s)
    times the tensor's largest true value from the float64 truth (plus 4 times how far the truth itself
    may be off), and the note to say of them. All of them where the float64 run fails."""
    pipe = _in_float64(job.split())
    args, kwargs, target = cast_inputs((job.args, job.kwargs, job.target), torch.float64, None, copy=True)
    mode = Float64Ops() if getattr(truth, "float32_ops", ()) or getattr(truth, "exact_ops", ()) else None
    in_float64 = dataclasses.replace(accumulation, dtype=None if accumulation.dtype is None else torch.float64)
    try:
        with mode if mode is not None else nullcontext(), seeded(seed):
            run = DetachExecutor(pipe, accumulation=in_float64).step(args, kwargs, loss_fn=job.loss_fn, target=target,
                                                                     n_microbatches=job.n_microbatches)
    except Exception as err:
        return set(names), (f"pipecheck's reference runner could not run in float64 to vouch for its re-orderings "
                            f"({type(err).__name__}: {first_line(err)[:160]}): only eager's own set the "
                            f"tolerances of {_names(names)}")
    error: StepResult | None = getattr(truth, "error", None)
    unsound = set()
    for name in names:
        ours, true, slack = _pick(run, name), _pick(truth, name), _pick(error, name) if error is not None else None
        if not (isinstance(ours, torch.Tensor) and isinstance(true, torch.Tensor) and ours.shape == true.shape):
            unsound.add(name)
            continue
        if not true.numel():
            continue
        mine = _pick(eager, name)
        eps = min(torch.finfo(dtype).eps, torch.finfo(mine.dtype).eps) if isinstance(mine, torch.Tensor) \
            and mine.is_floating_point() else torch.finfo(dtype).eps
        off = (ours.double() - true.double()).abs().nan_to_num(nan=float("inf"))
        allowed = GUARD * eps * float(true.double().abs().nan_to_num(posinf=0.0, neginf=0.0).max())
        if isinstance(slack, torch.Tensor):
            off = (off - 4 * slack.double()).clamp_min(0.0)
        if off.numel() and float(off.max()) > allowed:
            unsound.add(name)
    return unsound, (f"pipecheck's reference runner in float64 is off the float64 truth on {_names(unsound)}: its "
                     "re-orderings do not widen their tolerances (a bug of pipecheck's own: please report it)"
                     if unsound else "")


def _in_float64(pipe: Pipe) -> Pipe:
    """``pipe`` (a private copy) in float64: its parameters and buffers, and every floating dtype its
    graphs name (a trace records the casts, checks and factory calls of the dtypes it ran in)."""

    def widen(value: Any) -> Any:
        return torch.float64 if isinstance(value, torch.dtype) and value.is_floating_point else value

    for stage in pipe.stages:
        cast_module(stage.module, torch.float64)
        graphs = [*stage.module.modules(), *(region.module for region in regions_of(stage.module))]
        for module in graphs:
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    node.args, node.kwargs = pytree.tree_map(widen, (node.args, node.kwargs))
                module.recompile()
    return pipe


def _pick(result: StepResult, name: str) -> Any:
    """A row's value in a step's result (a gradient, input gradient or buffer)."""
    for prefix, values in (("grad input ", result.input_grads), ("grad ", result.grads), ("buffer ", result.buffers)):
        if name.startswith(prefix):
            return values.get(name.removeprefix(prefix))
    return None


def _names(names: Sequence[str] | set[str]) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:3]) + (f" and {len(ordered) - 3} more" if len(ordered) > 3 else "")


SUMMATIONS: tuple[Summation, ...] = (
    _in_order, lambda ts: _in_order(ts[::-1]), _pairwise, lambda ts: _in_order([t.float() for t in ts]).to(ts[0].dtype))
"""A training's micro-batch gradients summed first to last, last to first, pairwise, and in float32."""


def training_anchor(model: nn.Module, batches: list[Inputs], job: Job, eager: list[StepResult],
                    truth: list[StepResult], results: list[StepResult], targets: list[Any], seed: int
                    ) -> tuple[ToleranceLike, list[str]]:
    """Tolerance "auto" of a low-precision training check (see :func:`eager_anchor`): anchored on eager
    while the runner's first step's outputs are eager's bits. After the first optimizer step a correct
    engine's parameters are no longer eager's bits, and every later value re-rolls its rounding from
    there: each value's noise, step by step, is how far eager trained again with its micro-batch
    gradients summed in another order (SUMMATIONS) moves it, the optimizer's amplification included."""
    dtype = result_dtype(eager[0])
    named = str(dtype).removeprefix("torch.")
    differs = forward_difference(results[0], eager[0]) if results else ""
    if differs:
        return "auto", [f"the runner's first step's forward is not bit for bit eager's ({differs}): this {named} "
                        "training check is anchored on float64, whose tolerance grows with eager's own error and may "
                        "refuse tensors as blind"]
    g = job.training.accumulation_steps
    noise: dict[str, Noise] = {}
    for summation in SUMMATIONS:
        with seeded(seed):
            variant, _ = train_eager(copy.deepcopy(model), batches, job.training, job.loss_fn or projection_loss,
                                     job.n_microbatches, targets=targets, summation=summation)
        for t, (mine, theirs) in enumerate(zip(eager, variant)):
            values = dict((name, value) for name, _, value in step_values(theirs, _prefix(t, eager), g))
            for name, _, value in step_values(mine, _prefix(t, eager), g):
                other = values.get(name)
                if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.is_floating_point() \
                        and other.shape == value.shape:
                    noise[name] = noise.get(name, Noise()) | _deviation(other, value)
    zero = frozenset().union(*(_zero_of(step_values(e, _prefix(t, eager), g), step_values(r, _prefix(t, eager), g))
                               for t, (e, r) in enumerate(zip(eager, truth))))
    return EagerAnchored(noise, named, zero), []


def _prefix(t: int, steps: list[StepResult]) -> str:
    return f"step {t}: " if len(steps) > 1 else ""


def step_values(result: StepResult, prefix: str, g: int) -> list[tuple[str, str, Any]]:
    """One optimizer step's values by their rows' names (pipecheck._check.training names them so), with
    their kinds: outputs (one per schedule step when accumulating), loss, gradients, parameters, buffers."""
    values: list[tuple[str, str, Any]] = []
    outputs = [result.outputs] if g == 1 else list(result.outputs) if isinstance(result.outputs, (tuple, list)) else []
    for a, leaves in enumerate(outputs):
        suffix = f" (schedule step {a} of {g})" if g > 1 else ""
        values += [(prefix + output_name(path) + suffix, "outputs", leaf)
                   for path, leaf in pytree.tree_flatten_with_path(leaves)[0]]
    values.append((prefix + "loss", "loss", result.loss))
    values += [(f"{prefix}grad {fqn}", "grads", value) for fqn, value in result.grads.items()]
    values += [(f"{prefix}param {fqn}", "params", value) for fqn, value in result.params.items()]
    values += [(f"{prefix}buffer {fqn}", "buffers", value) for fqn, value in result.buffers.items()]
    return values
