"""Where, within its first failing optimizer step, a training check's runs part, and why.

    locate_step(report, t, run, "distributed", job, fresh_batches, results, eager, truth)
    report.located          # the step's line, then: "within it: stage 0 received the gradient of 'h' ..."
    report.first_divergence # that value as data (its optimizer and schedule step included)

Run only when a training check fails, after its verdict (it never changes one). The reference runs
optimizer step ``t`` from eager's parameters and buffers at the start of that step, micro-batch by
micro-batch, recording every boundary value: each micro-batch's share of the step's gradients (the
weight fit's basis), each stage's share (the tied-parameter hint) and the values a runner's are lined
up with. The runner trains again for ``t + 1`` steps with ``job.boundaries`` set; its values of step
``t`` are compared in dataflow order as a one-step check compares them (:mod:`pipecheck._check.localise`).

Micro-batches are numbered across the training run: schedule step ``i``'s micro-batch ``j`` of
data-parallel replica ``r`` is ``(i * data_parallel + r) * n_microbatches + j`` (the k-th forward of a
stage module of ``job.split()`` is micro-batch k, and a runner on other processes numbers what it
returns in ``StepResult.boundaries`` the same way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._check.compare import nan_notes
from pipecheck._check.diagnose import (
    diagnose_grad,
    diagnose_output,
    dropped_skip_hint,
    matches,
    microbatch_weights,
    weights_hint,
)
from pipecheck._check.eager import output_name
from pipecheck._check.localise import _said, not_located
from pipecheck._check.numerics import Row
from pipecheck._check.report import Report
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch
from pipecheck._runners.job import Job
from pipecheck._runners.training import reductions
from pipecheck._runtime.boundaries import (
    Boundaries,
    BoundaryKey,
    Divergence,
    first_divergence,
    producers_of,
    recording,
)
from pipecheck._runtime.randomness import microbatch, schedule_step
from pipecheck._runtime.reference import DetachExecutor, sum_stage_grads
from pipecheck._split.inputs import as_args
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.errors import plural
from pipecheck.losses import MicrobatchLoss, Reduction, valid_tokens


@dataclasses.dataclass
class StepTruth:
    """The reference's optimizer step ``t`` from eager's state, micro-batch by micro-batch."""

    shares: list[dict[str, torch.Tensor]]  # per micro-batch of the step (schedule step a's j-th: a * n + j)
    losses: list[torch.Tensor]  # each micro-batch's weighted loss, in the same order
    stage_grads: list[dict[str, torch.Tensor]]  # each stage's share of the step's gradients
    boundaries: list[Boundaries]  # per schedule step, micro-batches numbered 0..n-1


def failing_step(rows: Sequence[Row], steps: int) -> int | None:
    """The first optimizer step with a failing row (rows named ``step t: ...`` when there are several)."""
    for t in range(steps):
        prefix = f"step {t}: " if steps > 1 else ""
        if any(not row.ok and row.name.startswith(prefix) for row in rows):
            return t
    return None


def locate_step(report: Report, run: Any, runner_name: str, job: Job, fresh_batches: Callable[[], tuple[Batch, ...]],
                results: Sequence[StepResult], eager: Sequence[StepResult], truth: Sequence[StepResult]) -> None:
    """Add to a failing training check's ``report`` where within its first failing step the runs part
    (``located``, ``first_divergence``), the hints the one-step check gives, and its NaN note."""
    try:
        _locate(report, run, runner_name, job, fresh_batches, results, eager, truth)
    except Exception as err:  # a diagnosis that fails (out of memory) never hides the verdict
        report.located += "\nwithin it, " + not_located("locating it failed", err)


def _locate(report: Report, run: Any, runner_name: str, job: Job, fresh_batches: Callable[[], tuple[Batch, ...]],
            results: Sequence[StepResult], eager: Sequence[StepResult], truth: Sequence[StepResult]) -> None:
    steps = job.training.steps
    t = failing_step(report.rows, steps)
    if t is None:
        return
    prefix = f"step {t}: " if steps > 1 else ""
    rows = [row for row in report.rows if row.name.startswith(prefix)]
    report.notes += nan_notes([dataclasses.replace(row, name=row.name.removeprefix(prefix)) for row in rows])
    if job.training.data_parallel > 1:
        report.located += (f"\nwithin it, not located: with data_parallel={job.training.data_parallel} the "
                           "boundary values and micro-batch shares of one step are not compared yet")
        return
    start = eager[t - 1] if t > 0 else None
    try:
        reference = reference_step(job, t, start)
    except Exception as err:  # a diagnosis that fails (out of memory) never hides the verdict
        report.located += "\nwithin it, " + not_located("the reference could not run the step", err)
        return
    _hint_rows(report, t, prefix, rows, job, results[t], truth[t], reference, start)
    found, line = _within(t, run, runner_name, job, fresh_batches, reference, {row.kind for row in rows if not row.ok})
    report.first_divergence = found
    report.located += "\n" + line


# --- the reference's step t, from eager's state -------------------------------------------------------


def pipe_at(job: Job, start: StepResult | None) -> Pipe:
    """A private split holding eager's parameters and buffers after ``start`` (None: as built); its stages
    draw by pipecheck's randomness contract inside :func:`drawing`."""
    pipe = job.split()
    with torch.no_grad():
        for stage in pipe.stages:
            if start is None:
                continue
            for local, param in stage.module.named_parameters(remove_duplicate=False):
                value = start.params.get(stage.local_to_fqn.get(local, ""))
                if value is not None:  # no optimizer: the parameters never move
                    param.copy_(value)
            for local, buffer in stage.module.named_buffers(remove_duplicate=False):
                value = start.buffers.get(stage.buffer_fqns.get(local, ""))
                if value is not None:
                    buffer.copy_(value)
    return pipe


@contextmanager
def drawing(job: Job, t: int, a: int) -> Iterator[None]:
    """The randomness contract's position of schedule step ``a`` of optimizer step ``t`` (as the reference
    runner's training loop sets it)."""
    seed = job.training.random_seed
    with schedule_step(seed, t, a) if seed is not None else nullcontext():
        yield


def _schedule_steps(job: Job, t: int) -> list[tuple[Batch, Reduction]]:
    g = job.training.accumulation_steps
    return list(zip(job.optimizer_steps()[t], reductions(job)[t * g:(t + 1) * g]))


def reference_step(job: Job, t: int, start: StepResult | None) -> StepTruth:
    pipe = pipe_at(job, start)
    n = job.n_microbatches
    made = StepTruth([], [], [{} for _ in pipe.stages], [])
    executor = DetachExecutor(pipe, precision=job.precision)
    device = next((p.device for p in pipe.stages[0].module.parameters()), torch.device("cpu"))
    for a, (batch, reduction) in enumerate(_schedule_steps(job, t)):
        recorder = Boundaries()
        bound = pipe.bind_inputs(as_args(batch.args), batch.kwargs)
        loss_of = MicrobatchLoss(job.loss_fn, batch.target, n, reduction)
        with recording(pipe, recorder), drawing(job, t, a):
            for mb, values in enumerate(split_microbatches(bound, n, uneven=reduction.uneven)):
                with microbatch(mb), job.precision.forward(device):
                    forwards = executor.forward_microbatch(values)
                    loss = loss_of(mb, pytree.tree_unflatten(list(forwards[-1].outputs), pipe.out_spec))
                per_stage: list[dict[str, torch.Tensor]] = [{} for _ in pipe.stages]
                with microbatch(mb, backward=True):
                    executor.backward_microbatch(mb, forwards, loss, reduction.weight, per_stage,
                                                 [set() for _ in pipe.stages], {})
                made.shares.append(sum_stage_grads(per_stage))
                made.losses.append(loss.detach() * reduction.weight)
                for total, share in zip(made.stage_grads, per_stage):
                    for fqn, grad in share.items():
                        total[fqn] = total[fqn] + grad if fqn in total else grad
        made.boundaries.append(recorder)
    return made


# --- the runner's step t, recorded -------------------------------------------------------------------


def _within(t: int, run: Any, runner_name: str, job: Job, fresh_batches: Callable[[], tuple[Batch, ...]],
            reference: StepTruth, failing_kinds: set[str]) -> tuple[Divergence | None, str]:
    """The first divergent boundary value of step ``t`` and the report's line for it."""
    if getattr(run, "reference_boundaries", None) is not None:
        return None, (f"within it, not located: runner {runner_name!r} cuts the model itself, and locating a "
                      "training step compares the values of pipecheck's split (a one-step check locates it)")
    g, n = job.training.accumulation_steps, job.n_microbatches
    recorded = Boundaries()
    again = dataclasses.replace(job, training=dataclasses.replace(job.training, steps=t + 1),
                                batches=fresh_batches()[:(t + 1) * g], boundaries=recorded, trace_path=None)
    try:
        results = run.train(again)
    except Exception as err:  # the verdict stands; only the diagnosis is lost
        return None, "within it, " + not_located("training the runner again to record it failed", err)
    for result in results if isinstance(results, (list, tuple)) else ():
        if isinstance(result, StepResult) and result.boundaries:  # recorded on other processes
            recorded.imported(result.boundaries)
    if not recorded.values:
        return None, ("within it, not located: the runner recorded no boundary values (run the stage modules of "
                      "job.split(), or record them with job.boundaries.record and return them in "
                      "StepResult.boundaries, micro-batches numbered across the run: docs/training.md)")
    producers = producers_of(job.structure())
    counted = 0
    overwritten: dict[BoundaryKey, float] = {}
    scale = 1.0
    for a in range(g):
        first = (t * g + a) * n
        values = _shifted(recorded.values, first, n)
        truth = reference.boundaries[a].values
        counted += len(truth)
        overwritten.update(_shifted(recorded.overwritten, first, n))
        found, scale = first_divergence(values, truth, n, job.structure().num_stages, producers)
        if found is not None:
            found = dataclasses.replace(found, optimizer_step=t, schedule_step=a)
            where = f"within it (schedule step {a} of {g})" if g > 1 else "within it"
            scaled = f" (backward compared up to its one factor {scale:.4g})" if scale != 1.0 else ""
            return found, (f"{where}: {found.text().removeprefix('first divergence: ')}{scaled}"
                           + _crossing(found, values, truth, producers))
    if overwritten or failing_kinds & {"outputs", "loss", "grads", "buffers"}:
        said = _said(None, scale, Boundaries(overwritten=overwritten), counted, failing_kinds)[1]
        return None, "within it: " + said.removeprefix("first divergence: ")
    return None, (f"within it: no boundary value diverges ({plural(counted, 'value')} the stages received and sent, "
                  "forward and backward, match the reference) and the gradients before the optimizer match: the bug "
                  "is in the optimizer step (clipping, the update, which parameters and replicas it steps)")


def _shifted(values: Mapping[BoundaryKey, Any], first: int, n: int) -> dict[BoundaryKey, Any]:
    """The values of micro-batches ``first .. first + n - 1`` of the run, numbered 0 .. n - 1."""
    return {(stage, mb - first, point, name): value for (stage, mb, point, name), value in values.items()
            if first <= mb < first + n}


def _crossing(found: Divergence, test: Mapping[BoundaryKey, torch.Tensor], truth: Mapping[BoundaryKey, torch.Tensor],
              producers: Mapping[tuple[int, str], int | None]) -> str:
    """Where a value that diverges on arrival was still right: the stages that sent it (its producer in the
    forward, its consumers in the backward), when they sent it right."""
    base = found.value.split("[", 1)[0]
    if found.point == "received" and found.producer is not None:
        senders, point = [found.producer], "sent"
    elif found.point == "grad received":
        senders = sorted(s for (s, name), p in producers.items() if name == base and p == found.stage)
        point = "grad sent"
    else:
        return ""
    keys = [key for key in truth if key[0] in senders and key[2] == point and key[3].split("[", 1)[0] == base
            and key[1] in found.microbatches]
    if not keys or not all(key in test and matches(test[key], truth[key]) for key in keys):
        return ""
    who = ", ".join(map(str, senders))
    what = "sent it" if point == "sent" else "sent its gradient back"
    arrived = [(test[key], truth[key]) for key in truth if key[0] == found.stage and key[2] == found.point
               and key[3] == found.value and key[1] in found.microbatches and key in test]
    factor = _factor(arrived)
    times = (f": it arrived {factor:.4g} times what was sent" + (" (delivered twice: a gradient hook or a receive "
             "registered again, e.g. on a buffer kept from an earlier step)" if abs(factor - 2) < 1e-3 else "")
             if factor is not None else ": it changed on the way")
    return (f"; stage{'s' if len(senders) > 1 else ''} {who} {what} right{times}, in what the engine does between "
            f"stage{'s' if len(senders) > 1 else ''} {who} and stage {found.stage} (a send, a receive buffer, a hook)")


def _factor(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    """The one factor c with every test value = c x its reference value, if there is one (not 1)."""
    if not pairs or any(a.shape != b.shape or not a.is_floating_point() for a, b in pairs):
        return None
    dot = sum(float((a.double() * b.double()).sum()) for a, b in pairs)
    norm = sum(float((b.double() ** 2).sum()) for _, b in pairs)
    if not norm > 0:
        return None
    factor = dot / norm
    if abs(factor - 1) <= 1e-3 or not all(matches(a, b * factor) for a, b in pairs):
        return None
    return factor


# --- hints, as the one-step check gives them ---------------------------------------------------------


def _hint_rows(report: Report, t: int, prefix: str, rows: list[Row], job: Job, result: StepResult,
               truth: StepResult, reference: StepTruth, start: StepResult | None) -> None:
    """Hints on step ``t``'s failing rows that have none yet (only on failure; never a verdict)."""
    hints = report.hints
    failing = [row for row in rows if not row.ok and row.numel and row.name not in hints]
    grads = {row.name: row.name.removeprefix(prefix + "grad ") for row in failing
             if row.kind == "grads" and " (" not in row.name}
    grads = {name: fqn for name, fqn in grads.items() if isinstance(result.grads.get(fqn), torch.Tensor)}
    pipe = job.structure()
    for name, fqn in grads.items():
        holders = pipe.param_stages(fqn)
        shares = [(s, reference.stage_grads[s][fqn]) for s in holders if fqn in reference.stage_grads[s]]
        hint = diagnose_grad(result.grads[fqn], truth.grads[fqn], job.n_microbatches, shares) \
            if len(shares) > 1 else None
        if hint:
            hints[name] = hint
    _dropped_skips(job, t, start, {name: fqn for name, fqn in grads.items() if name not in hints}, result, hints)
    weights = _microbatch_weights(job, t, {name: fqn for name, fqn in grads.items() if name not in hints}, result,
                                  reference, hints)
    loss_row = prefix + "loss"
    if weights is not None and loss_row in {row.name for row in failing} and isinstance(result.loss, torch.Tensor):
        weighted = sum(w * loss.double() for w, loss in zip(weights, reference.losses))
        if matches(result.loss.double(), torch.as_tensor(weighted)):
            hints[loss_row] = ("the loss is the micro-batches' losses weighted as the gradients are ("
                               + ", ".join(f"{w:.3g}" for w in weights) + ") where eager has 1 each")
    _permuted_outputs(job, prefix, failing, result, truth, hints)


def _dropped_skips(job: Job, t: int, start: StepResult | None, failing: dict[str, str], result: StepResult,
                   hints: dict[str, str]) -> None:
    """Do the failing gradients match step ``t`` run with one skip edge's gradient dropped? (One what-if
    reference run of the step per skip edge.)"""
    skips = sorted({(e.src, e.name, e.dst) for e in job.structure().edges if e.src is not None and e.dst - e.src > 1})
    for producer, name, consumer in skips if failing else ():
        pipe = pipe_at(job, start)
        what_if: dict[str, torch.Tensor] = {}
        for a, (batch, reduction) in enumerate(_schedule_steps(job, t)):
            with drawing(job, t, a):
                step = DetachExecutor(pipe, drop_gradients=[(producer, name, consumer)], precision=job.precision).step(
                    batch.args, batch.kwargs, loss_fn=job.loss_fn, target=batch.target,
                    n_microbatches=job.n_microbatches, reduction=reduction)
            for fqn, grad in step.grads.items():
                what_if[fqn] = what_if[fqn] + grad if fqn in what_if else grad
        if all(fqn in what_if and matches(result.grads[fqn], what_if[fqn]) for fqn in failing.values()):
            for row in failing:
                hints[row] = dropped_skip_hint(name, producer, consumer)
            return


def _microbatch_weights(job: Job, t: int, failing: dict[str, str], result: StepResult, reference: StepTruth,
                        hints: dict[str, str]) -> list[float] | None:
    """Fit each failing gradient as a weighted sum of the step's micro-batches' own (the reference's from
    eager's state); say what the weights mean. Returns the first fit's weights."""
    first: list[float] | None = None
    for name, fqn in failing.items():
        if not any(fqn in share for share in reference.shares):
            continue
        weights = _fit(result.grads[fqn], [share.get(fqn) for share in reference.shares])
        hint = weights_hint(weights) if weights is not None else None
        if weights is None or hint is None:
            continue
        first = first or weights
        hints[name] = _token_means(job, t, weights) or _numbered(hint, job)
    return first


def _fit(test: torch.Tensor, shares: Sequence[torch.Tensor | None]) -> list[float] | None:
    """:func:`microbatch_weights` over the step's micro-batches, those whose shares are identical (a batch
    given for several schedule steps) fitted as one and their weight shared equally."""
    groups: list[list[int]] = []
    for k, share in enumerate(shares):
        same = next((group for group in groups if share is not None and shares[group[0]] is not None
                     and torch.equal(shares[group[0]], share)), None)  # type: ignore[arg-type]
        if same is None:
            groups.append([k])
        else:
            same.append(k)
    basis = [shares[group[0]] for group in groups]
    fitted = microbatch_weights(test, [torch.zeros_like(test) if b is None else b for b in basis])
    if fitted is None:
        return None
    weights = [0.0] * len(shares)
    for group, weight in zip(groups, fitted):
        for k in group:
            weights[k] = weight / len(group)
    return weights


def _numbered(hint: str, job: Job) -> str:
    g = job.training.accumulation_steps
    return hint if g == 1 else (hint + f" (micro-batches numbered across the optimizer step's {g} schedule steps, "
                                f"{job.n_microbatches} each)")


def _token_means(job: Job, t: int, weights: list[float]) -> str | None:
    """Weights that say each micro-batch's loss was its own token mean, where the job asks the global one."""
    if job.training.loss_reduction != "token_mean":
        return None
    counts = []
    for batch, reduction in _schedule_steps(job, t):
        for target in split_microbatches(batch.target, job.n_microbatches, "target", uneven=reduction.uneven):
            counts.append(valid_tokens(target, job.training.ignore_index))
    total, k = sum(counts), len(counts)
    if len(counts) != len(weights) or not all(counts) or not all(
            abs(w - total / (k * c)) <= 1e-3 * (total / (k * c)) for w, c in zip(weights, counts)):
        return None
    shown = ", ".join(f"{w:.3g}" for w in weights)
    return (f"token mean of means: the gradient is the micro-batches' eager gradients weighted ({shown}) where eager "
            f"has 1 each, which is the step's {total} valid tokens over {k} x each micro-batch's own "
            f"({', '.join(map(str, counts))}): each micro-batch's loss was divided by its own valid tokens and the "
            f"step's {k} micro-batch losses averaged, where loss_reduction='token_mean' divides every token's loss by "
            f"the step's {total}. Fix: divide each micro-batch's summed token losses by the whole optimizer step's "
            "valid tokens")


def _permuted_outputs(job: Job, prefix: str, failing: list[Row], result: StepResult, truth: StepResult,
                      hints: dict[str, str]) -> None:
    """Failing outputs whose micro-batches are another micro-batch's (merged in the wrong order)."""
    g = job.training.accumulation_steps
    names = {row.name for row in failing if row.kind == "outputs"}
    for a in range(g if names else 0):
        suffix = f" (schedule step {a} of {g})" if g > 1 else ""
        expected = truth.outputs if g == 1 else truth.outputs[a]
        tested = result.outputs if g == 1 else result.outputs[a] if isinstance(result.outputs, (tuple, list)) \
            and len(result.outputs) == g else None
        got = {output_name(path): leaf for path, leaf in pytree.tree_flatten_with_path(tested)[0]}
        for path, leaf in pytree.tree_flatten_with_path(expected)[0]:
            name = output_name(path)
            test = got.get(name)
            if prefix + name + suffix in names and isinstance(test, torch.Tensor) and isinstance(leaf, torch.Tensor):
                hint = diagnose_output(test, leaf, job.n_microbatches)
                if hint:
                    hints[prefix + name + suffix] = hint
