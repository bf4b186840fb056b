"""Every row of a check: the runner's result against eager and the fp64 truth, with hints.

    rows, hints, notes = compare_all(pipe, job, result, eager, ref64, tolerance, True, initial_buffers)

Outputs are matched by key path (so a dict in another order, or a list for a
tuple, is the same output); every eager gradient is compared, each replica of
a tied parameter where the runner reports replicas, and a gradient the runner
produces that eager does not (unused or frozen parameter, a renamed FQN) fails
unless it is all zeros. Buffers after the step are compared as ``buffer <fqn>``
rows when the runner reports buffers; one it leaves out fails only if the
eager step changed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._check.diagnose import (
    diagnose_grad,
    diagnose_output,
    dropped_skip_hint,
    matches,
    microbatch_weights,
    weights_hint,
)
from pipecheck._check.eager import output_name
from pipecheck._check.localise import ReferenceByMicrobatch
from pipecheck._check.numerics import Row, ToleranceLike, compare, judge_power
from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.errors import plural


def compare_all(pipe: Pipe, job: Job, result: StepResult, eager: StepResult, ref64: StepResult,
                tolerance: ToleranceLike, check_grads: bool, initial_buffers: dict[str, torch.Tensor],
                reference: ReferenceByMicrobatch | None = None) -> tuple[list[Row], dict[str, str], list[str]]:
    """``reference``: the job's micro-batch by micro-batch reference run, shared with the locating step."""
    reference = reference or ReferenceByMicrobatch(job)
    rows: list[Row] = []
    hints: dict[str, str] = {}
    notes: list[str] = []
    _compare_outputs(pipe, job, result, eager, ref64, tolerance, rows, hints)
    rows.append(compare("loss", result.loss, eager.loss, ref64.loss, tolerance, (pipe.num_stages - 1,),
                        truth_error=_error(ref64, "loss"), kind="loss"))
    _compare_buffers(pipe, job, result, eager, ref64, tolerance, initial_buffers, rows, hints, notes)
    if check_grads:
        _compare_grads(pipe, job, result, eager, ref64, tolerance, rows, hints, reference)
    return judge_power(rows), hints, getattr(ref64, "notes", []) + list(result.notes) + notes + nan_notes(rows)


def _error(ref64: StepResult, field: str, key: Any = None) -> torch.Tensor | None:
    """How far the truth's own value may be off (a float64 truth that ran some op in float32:
    pipecheck._check.truth64.Truth.error), or None: exact. ``key`` picks a gradient, buffer or output leaf."""
    error = getattr(ref64, "error", None)
    if error is None:
        return None
    if field == "outputs":
        leaves = pytree.tree_leaves(error.outputs)
        return leaves[key] if key < len(leaves) else None
    value = getattr(error, field)
    return value.get(key) if isinstance(value, dict) else value


def _compare_grads(pipe: Pipe, job: Job, result: StepResult, eager: StepResult, ref64: StepResult,
                   tolerance: ToleranceLike, rows: list[Row], hints: dict[str, str],
                   reference: ReferenceByMicrobatch) -> None:
    _compare_param_grads(pipe, job, result, eager, ref64, tolerance, rows, hints)
    _diagnose_dropped_skips(pipe, job, result, rows, hints)
    _diagnose_microbatch_weights(job, result, rows, hints, reference)
    for name, e_grad in eager.input_grads.items():
        _grad_row(f"grad input {name}", result.input_grads.get(name), e_grad, ref64.input_grads[name],
                  tolerance, _consumers(pipe, name), job, rows, hints, truth_error=_error(ref64, "input_grads", name))
    unexpected_grads(result.grads, eager.grads, "grad ", pipe.param_stages, rows, hints,
                      "eager computes no gradient here (an unused or frozen parameter, or not an original FQN: "
                      "runners key gradients by model.named_parameters() names)")
    unexpected_grads(result.input_grads, eager.input_grads, "grad input ", lambda name: _consumers(pipe, name),
                      rows, hints, "eager computes no gradient for this input (it does not require grad, or "
                      "no output depends on it through a differentiable path): a runner must not invent one")


def nan_notes(rows: list[Row]) -> list[str]:
    """Where the runner's NaN first shows, in dataflow order: the forward's values (outputs, loss)
    come before every gradient, and the backward runs from the last stage to the first."""
    poisoned = [row for row in rows if row.n_nan]
    if not poisoned:
        return []
    forward = [row for row in poisoned if not row.name.startswith("grad ")]
    if forward:
        first = "already in the forward: " + ", ".join(
            f"{row.name} (stage {','.join(map(str, row.stages)) or '-'})" for row in forward)
    else:
        last = max(max(row.stages, default=-1) for row in poisoned)
        on_it = [row.name for row in poisoned if last in row.stages]
        first = (f"only in the backward (outputs and loss are numbers), first on stage {last}, the highest-"
                 f"numbered stage with a NaN gradient ({', '.join(on_it[:3])}{' ...' if len(on_it) > 3 else ''}): "
                 "the backward runs from the last stage to the first")
    total = sum(row.n_nan for row in poisoned)
    return [f"the runner produced NaN where eager has numbers: {plural(total, 'element')} in "
            f"{plural(len(poisoned), 'row')} (shown as inf errors), {first}."]


def _consumers(pipe: Pipe, name: str) -> tuple[int, ...]:
    """The stages that read model input ``name``."""
    return tuple(sorted({e.dst for e in pipe.edges if e.src is None and e.name == name}))


def _compare_buffers(pipe: Pipe, job: Job, result: StepResult, eager: StepResult, ref64: StepResult,
                     tolerance: ToleranceLike, initial: dict[str, torch.Tensor], rows: list[Row],
                     hints: dict[str, str], notes: list[str]) -> None:
    """``buffer <fqn>`` rows: each buffer after the step against the eager model's after its micro-batches."""
    changed = [fqn for fqn, after in eager.buffers.items()
               if fqn in initial and not _same(after, initial[fqn])]
    if not result.buffers:
        if eager.buffers:
            notes.append(f"buffers were not compared: the runner reported none ({len(changed)} of "
                         f"{len(eager.buffers)} buffers change during the eager step)")
        return
    failing: list[str] = []
    for fqn, after in eager.buffers.items():
        if fqn not in result.buffers and fqn not in changed:
            continue  # never touched by the step: a runner need not report it
        name = f"buffer {fqn}"
        row = compare(name, result.buffers.get(fqn), after, ref64.buffers[fqn], tolerance, pipe.buffer_stages(fqn),
                      truth_error=_error(ref64, "buffers", fqn), kind="buffers")
        rows.append(row)
        if not row.ok and row.numel and fqn in changed and job.n_microbatches > 1:
            failing.append(fqn)
    if failing:
        _diagnose_buffers(job, result, failing, hints)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def _diagnose_buffers(job: Job, result: StepResult, failing: list[str], hints: dict[str, str]) -> None:
    """Does a failing buffer hold one micro-batch's update alone (updates not carried from one
    micro-batch to the next)? One what-if reference run per micro-batch, only on failure."""
    n = job.n_microbatches
    inputs = split_microbatches((job.args, job.kwargs), n)
    targets = split_microbatches(job.target, n, "target") if job.target is not None else [None] * n
    alone = [DetachExecutor(job.split(), precision=job.precision).step(args, kwargs, loss_fn=job.loss_fn,
                                                                       target=target).buffers
             for (args, kwargs), target in zip(inputs, targets)]
    for fqn in failing:
        found = [mb for mb, buffers in enumerate(alone) if fqn in buffers and matches(result.buffers[fqn], buffers[fqn])]
        if found:
            which = f"micro-batch {found[0]}'s update" if len(found) == 1 else "one micro-batch's update"
            hints[f"buffer {fqn}"] = (
                f"buffer holds {which} alone: each micro-batch must update the buffer the previous one left "
                f"(carry buffers from micro-batch to micro-batch, in order), as eager does over all {n}")


def _compare_outputs(pipe: Pipe, job: Job, result: StepResult, eager: StepResult, ref64: StepResult,
                     tolerance: ToleranceLike, rows: list[Row], hints: dict[str, str]) -> None:
    last = (pipe.num_stages - 1,)
    eager_out = pytree.tree_flatten_with_path(eager.outputs)[0]
    ref_out = pytree.tree_leaves(ref64.outputs)
    test_out = {output_name(path): leaf for path, leaf in pytree.tree_flatten_with_path(result.outputs)[0]}
    eager_names = [output_name(path) for path, _ in eager_out]
    for i, ((_, e_leaf), r_leaf) in enumerate(zip(eager_out, ref_out)):
        source = pipe.output_sources[i] if i < len(pipe.output_sources) else None
        stages = (source.stage,) if source is not None and source.stage is not None else last
        name = eager_names[i]
        test = test_out.get(name)
        row = compare(name, test, e_leaf, r_leaf, tolerance, stages, microbatches=job.n_microbatches,
                      truth_error=_error(ref64, "outputs", i), kind="outputs")
        rows.append(row)
        if name not in test_out:
            hints[name] = f"output structure differs: the runner returned {sorted(test_out) or 'no outputs'}"
        elif not row.ok and row.numel and isinstance(test, torch.Tensor):
            hint = diagnose_output(test, r_leaf, job.n_microbatches)
            if hint:
                hints[name] = hint
    for name in sorted(set(test_out) - set(eager_names)):
        rows.append(Row(name, (), (), False, float("inf"), float("inf"), "-", None, 1, 1,
                        "not an output of the eager model", kind="outputs"))


def _grad_row(name: str, test: Any, e_grad: torch.Tensor, truth: torch.Tensor, tolerance: ToleranceLike,
              stages: tuple[int, ...], job: Job, rows: list[Row], hints: dict[str, str],
              shares: Callable[[], list[tuple[int, torch.Tensor]]] = list,
              truth_error: torch.Tensor | None = None) -> None:
    """One gradient's row, with a hint when it fails in a recognisable way (``shares`` is only
    called then: a tied parameter's per-stage shares cost one more reference run)."""
    row = compare(name, test, e_grad, truth, tolerance, stages, truth_error=truth_error, kind="grads")
    rows.append(row)
    if not row.ok and row.numel and isinstance(test, torch.Tensor):
        hint = diagnose_grad(test, truth, job.n_microbatches, shares())
        if hint:
            hints[name] = hint


def _compare_param_grads(pipe: Pipe, job: Job, result: StepResult, eager: StepResult, ref64: StepResult,
                         tolerance: ToleranceLike, rows: list[Row], hints: dict[str, str]) -> None:
    cache: list[list[dict[str, torch.Tensor]]] = []

    def shares_of(fqn: str) -> Callable[[], list[tuple[int, torch.Tensor]]]:
        def shares() -> list[tuple[int, torch.Tensor]]:
            if len(pipe.param_stages(fqn)) < 2:
                return []
            if not cache:
                cache.append(stage_shares(job))
            return [(s, cache[0][s][fqn]) for s in pipe.param_stages(fqn) if fqn in cache[0][s]]
        return shares

    for fqn, e_grad in eager.grads.items():
        truth, stages = ref64.grads[fqn], pipe.param_stages(fqn)
        error = _error(ref64, "grads", fqn)
        _grad_row(f"grad {fqn}", result.grads.get(fqn), e_grad, truth, tolerance, stages, job, rows, hints,
                  shares_of(fqn), error)
        for stage, replica in sorted(result.replica_grads.get(fqn, {}).items()):
            _grad_row(f"grad {fqn} (replica in stage {stage})", replica, e_grad, truth, tolerance, (stage,),
                      job, rows, hints, shares_of(fqn), error)


def unexpected_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], prefix: str,
                      stages_of: Callable[[str], tuple[int, ...]], rows: list[Row], hints: dict[str, str],
                      hint: str) -> None:
    """A gradient eager does not have must be absent or all zeros: an optimizer would apply it."""
    for key in sorted(set(got) - set(expected)):
        grad = got[key]
        if not isinstance(grad, torch.Tensor) or not bool((grad != 0).any()):
            continue
        name = f"{prefix}{key}"
        magnitude = grad.detach().abs().max().item()
        rows.append(Row(name, stages_of(key), tuple(grad.shape), False, magnitude, float("inf"),
                        "zero expected", None, int((grad != 0).sum()), grad.numel(), kind="grads"))
        hints[name] = hint


def _diagnose_dropped_skips(pipe: Pipe, job: Job, result: StepResult, rows: list[Row],
                            hints: dict[str, str]) -> None:
    """Failing gradients with no hint yet: do they match the reference with one skip edge's
    gradient dropped? (One what-if reference run per skip edge, only on failure.)"""
    failing = {row.name.removeprefix("grad "): result.grads[row.name.removeprefix("grad ")] for row in rows
               if row.name.startswith("grad ") and not row.ok and row.numel and row.name not in hints
               and isinstance(result.grads.get(row.name.removeprefix("grad ")), torch.Tensor)}
    skips = sorted({(e.src, e.name, e.dst) for e in pipe.edges if e.src is not None and e.dst - e.src > 1})
    for producer, name, consumer in skips if failing else ():
        what_if = DetachExecutor(job.split(), drop_gradients=[(producer, name, consumer)],
                                 precision=job.precision).step(
            job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target, n_microbatches=job.n_microbatches)
        if all(fqn in what_if.grads and matches(test, what_if.grads[fqn]) for fqn, test in failing.items()):
            for fqn in failing:
                hints[f"grad {fqn}"] = dropped_skip_hint(name, producer, consumer)
            return


def _diagnose_microbatch_weights(job: Job, result: StepResult, rows: list[Row], hints: dict[str, str],
                                 reference: ReferenceByMicrobatch) -> None:
    """Failing gradients with no hint yet: fit each as a weighted sum of the micro-batches' own eager
    gradients, and say what the weights mean (one more reference run, only on failure)."""
    failing = [row.name.removeprefix("grad ") for row in rows
               if row.kind == "grads" and not row.ok and row.numel and row.name not in hints
               and isinstance(result.grads.get(row.name.removeprefix("grad ")), torch.Tensor)]
    if not failing or job.n_microbatches < 2:
        return
    try:
        shares, _ = reference.get()
    except Exception:  # a hint that cannot be computed (out of memory) is no hint, never a lost verdict
        return
    for fqn in failing:
        if not all(fqn in share for share in shares):
            continue
        weights = microbatch_weights(result.grads[fqn], [share[fqn] for share in shares])
        hint = weights_hint(weights) if weights is not None else None
        if hint:
            hints[f"grad {fqn}"] = hint


def stage_shares(job: Job) -> list[dict[str, torch.Tensor]]:
    """Each stage's own share of every parameter gradient, from the reference runner."""
    result = DetachExecutor(job.split(), precision=job.precision).step(
        job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target, n_microbatches=job.n_microbatches)
    return result.stage_grads
