"""A check that trains: every optimizer step of the runner's engine against eager trained the same way.

    report = check_training(run, "distributed", job, built, inputs, tolerance, check_grads, seed, clock)

The eager model (in the check's dtype) and its float64 copy (the truth) train the same steps on the
same batches. After every optimizer step the runner's loss, outputs, gradients before the optimizer,
every parameter and every tied or data-parallel copy after it, and the buffers are compared with them,
row by row, named ``step t: grad fc.weight`` (no prefix for a one-step check). Tolerance "auto"
holds each step to eager's own error at that step plus how far eager drifts when trained again on
gradients moved by that error (:func:`_perturbation`): after the first step a correct engine's
rounding is its own, and an optimizer can amplify it.

On failure the report says where the runs part: the first optimizer step with a failing row, and the
first kind of value there in the order a step computes them (outputs and loss, gradients, parameters,
buffers), with a hint when the pattern is known (gradients never zeroed between steps, an update the
optimizer applied differently to gradients that match).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._check.anchor import low_precision, training_anchor
from pipecheck._check.compare import unexpected_grads
from pipecheck._check.determinism import check_deterministic
from pipecheck._check.diagnose import diagnose_grad, matches
from pipecheck._check.draw_hints import wrong_draws_hint
from pipecheck._check.draws import Replay, record_draws
from pipecheck._check.eager import check_finite, output_name
from pipecheck._check.numerics import Row, ToleranceLike, compare, judge_power
from pipecheck._check.report import Report
from pipecheck._check.rounding import rounding_excused
from pipecheck._check.train_eager import (
    cast_batches,
    float64_copy,
    prepared_batches,
    train_eager,
)
from pipecheck._check.train_locate import locate_step
from pipecheck._check.truth64 import float64_failure_explained
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runners.job import Job
from pipecheck._runtime.randomness import microbatch, schedule_step
from pipecheck._split.inputs import Inputs, cast_module
from pipecheck._split.model_factory import seeded
from pipecheck._split.pipe import Pipe
from pipecheck.errors import EngineError, InputError, PipecheckError, plural
from pipecheck.losses import projection_loss

ORDER = ("outputs", "loss", "grads", "params", "buffers")  # how one optimizer step computes them


def refuse_one_call(run: Any, runner_name: str, training: Training) -> Callable[[Job], Any]:
    """The runner's ``train`` method (a one-call runner's call, where the check is one plain step made a
    training check by its random ops), or an InputError saying what a training check needs (before any
    eager work)."""
    train = getattr(run, "train", None)
    if callable(train):
        return train
    if dataclasses.replace(training, dropout=(), random_seed=None) == Training():
        return lambda job: [run(job)]
    raise InputError(f"runner {runner_name!r} runs one step per call (runner(job)); a check of "
                     f"{training.describe()} needs an engine kept from step to step: a runner with a method "
                     "train(job) -> list[StepResult], one per optimizer step. Fix: runner='reference' or "
                     "runner='distributed', or give your runner a train method (docs/training.md).")


def check_training(run: Any, runner_name: str, job: Job, built: torch.nn.Module, inputs: Inputs,
                   tolerance: ToleranceLike, check_grads: bool, seed: int,
                   clock: Callable[[str], AbstractContextManager[None]], dtype: torch.dtype | None = None,
                   device: str | None = None) -> Report:
    """The report of a training check (a verdict still to judge: see assert_equivalent)."""
    train = refuse_one_call(run, runner_name, job.training)
    pipe = job.structure()
    with clock("eager_s"):
        given = list(job.batches) or [Batch(*inputs.source)] * job.training.schedule_steps  # the caller's own
        batches = prepared_batches(built, given, dtype, device)  # tensors, read only: never a copy a run wrote into
        check_batch_sizes(batches, job)
        uneven = job.training.loss_reduction != "mean"  # its micro-batches may differ in size: probe them whole
        replay = Replay(record_draws(job, batches, seed)) if job.training.random_seed is not None else nullcontext()
        with replay:  # eager and its truth draw the stages' random numbers: any other randomness shows
            with schedule_step(seed, 0, 0), microbatch(0), (replay.probe(built) if isinstance(replay, Replay)
                                                            else nullcontext()):
                check_deterministic(built, inputs, 1 if uneven else job.n_microbatches * job.training.data_parallel,
                                    seed)
            eager, truth, targets, drift = eager_runs(built, batches, job, seed)
    job = dataclasses.replace(job, loss_fn=job.loss_fn or projection_loss, target=targets[0],
                              batches=training_batches(batches, targets))
    with clock("runner_s"):
        results = runner_steps(train, runner_name, job)
    anchored: ToleranceLike = tolerance
    notes: list[str] = []
    if tolerance == "auto" and eager and low_precision(eager[0]):  # float64 is too far from eager to anchor on
        with clock("anchor_s"):
            with replay:
                anchored, notes = training_anchor(built, batches, job, eager, truth, results, targets, seed)
    with clock("compare_s"):
        rows, hints, located = compare_steps(pipe, job, results, eager, truth, anchored, check_grads, drift)
    out_dtype = next((leaf.dtype for leaf in pytree.tree_leaves(eager[0].outputs)
                  if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()), torch.float32)
    notes += [note for result in results[:1] for note in result.notes]
    if job.training.data_parallel > 1 and eager[0].buffers:
        notes.append("buffers were not compared: each data-parallel replica updates its own from its shard")
    if job.training.data_parallel > 1 and not any(result.dp_params or result.dp_grads for result in results):
        notes.append(f"the runner reported no copy of data-parallel replicas 1 to {job.training.data_parallel - 1} "
                     "(StepResult.dp_grads, dp_params): only replica 0's gradients and parameters were compared")
    report = Report(runner_name, rows, hints, str(anchored),
                    str(out_dtype).replace("torch.", ""), job.n_microbatches, pipe.num_stages, {}, notes, pipe.tracer,
                    training=job.training.describe())
    report.located = located
    if not report.ok and tolerance == "auto" and anchored == tolerance and _one_plain_step(job):
        with clock("rounding_s"):  # as a one-step check: a re-ordering of the same math moving a row as far
            report.rows, excused = _rounding_excused(report.rows, job, seed)
        report.notes.extend(excused)
    if not report.ok:  # where within the failing step, and why: only on failure, never changing the verdict
        with clock("locate_s"):
            locate_step(report, run, runner_name, job, lambda: training_batches(batches, targets), results, eager, truth)
    return report


def _one_plain_step(job: Job) -> bool:
    """A one-step check made a training check by its random ops: one step of the mean loss, no optimizer."""
    train = job.training
    return dataclasses.replace(train, dropout=(), random_seed=None) == Training() and not job.batches[1:]


def _rounding_excused(rows: list[Row], job: Job, seed: int) -> tuple[list[Row], list[str]]:
    """:func:`rounding_excused` with the reference drawing by the randomness contract (its re-orderings draw
    the same numbers: only their rounding differs)."""
    random_seed = job.training.random_seed
    with schedule_step(random_seed, 0, 0) if random_seed is not None else nullcontext():
        return rounding_excused(rows, job, seed)


def eager_runs(built: torch.nn.Module, batches: list[Inputs], job: Job, seed: int
               ) -> tuple[list[StepResult], list[StepResult], list[Any], list[StepResult | None]]:
    """Eager trained in its dtype, the float64 truth trained the same way, each batch's target, and
    per step how far a correct engine may drift from eager through the optimizer (see :func:`_perturbation`)."""
    model = copy.deepcopy(built)  # the split's stages share ``built``'s parameters: train copies only
    n = job.n_microbatches  # per replica: eager cuts each batch into the replicas' shards, as the runners do
    with seeded(seed):
        eager, targets = train_eager(model, batches, job.training, job.loss_fn, n)
    del model
    for step in eager:
        check_finite(step)
    batches64, targets64 = cast_batches(batches, targets, torch.float64)
    with seeded(seed), float64_failure_explained(built):  # a model that fails in float64: said as one-step says it
        truth, _ = train_eager(float64_copy(built), batches64, job.training, job.loss_fn or projection_loss,
                               n, targets=targets64)
    rounding: list[StepResult | None] = [None] * len(truth)
    if eager and _dtype_of(eager[0]) == torch.float64:  # eager is its own truth: float64's rounding estimated
        rounding = _float64_rounding(built, batches, job, targets, truth, seed)
    drift: list[StepResult | None] = list(rounding)
    if job.training.optimizer is not None and len(truth) > 0:
        for draw in range(DRIFT_RUNS):  # eager again in its dtype, on gradients moved by its own error
            with seeded(seed):
                moved, _ = train_eager(copy.deepcopy(built), batches, job.training, job.loss_fn or projection_loss,
                                       n, targets=targets,
                                       perturb=_perturbation(eager, truth, seed + 1 + draw, rounding))
            drift = [_larger(old, _difference(a, b)) for old, a, b in zip(drift, moved, eager)]
    return eager, truth, targets, drift


def _dtype_of(result: StepResult) -> torch.dtype | None:
    return next((leaf.dtype for leaf in pytree.tree_leaves(result.outputs)
                 if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()), None)


def _float64_rounding(built: torch.nn.Module, batches: list[Inputs], job: Job, targets: list[Any],
                      truth: list[StepResult], seed: int) -> list[StepResult | None]:
    """A float64 check's truth is its own eager run, which leaves a correct engine no room for its own
    rounding (a gradient summed in another order moves the parameters by an ulp, and every later step
    re-rolls its rounding from there). Estimated one rung down the precision ladder, value by value and
    step by step: eager trained in float32 is off float64 by float32's error, and float64's is that
    times eps(float64) / eps(float32), as the one-step check's truth does (pipecheck._check.truth64).
    None per step where the model does not train in float32."""
    ratio = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    batches32, targets32 = cast_batches(batches, targets, torch.float32)
    try:
        with seeded(seed):
            trained, _ = train_eager(cast_module(copy.deepcopy(built), torch.float32), batches32, job.training,
                                     job.loss_fn or projection_loss, job.n_microbatches, targets=targets32)
    except Exception:  # a model that runs only in float64: no estimate, the float64 floor alone
        return [None] * len(truth)
    return [_scaled(_difference(a, b), ratio) for a, b in zip(trained, truth)]


def _scaled(result: StepResult, factor: float) -> StepResult:
    """Every tensor of ``result`` times ``factor``, in float64."""
    return StepResult(**{field: pytree.tree_map(
        lambda v: v.double() * factor if isinstance(v, torch.Tensor) else v, getattr(result, field))
        for field in ("outputs", "loss", "grads", "buffers", "params")})


DRIFT_RUNS = 2  # a correct engine's drift, sampled twice: one sample can be small by chance
DRIFT_SCALE = 2.0  # gradients moved by twice eager's own error: a correct engine's rounding is not eager's


def _larger(a: StepResult | None, b: StepResult) -> StepResult:
    """Value by value the larger of two drifts."""
    if a is None:
        return b

    def larger(x: Any, y: Any) -> Any:
        return torch.maximum(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) \
            and x.shape == y.shape else (x if x is not None else y)
    return StepResult(pytree.tree_map(larger, a.outputs, b.outputs), larger(a.loss, b.loss),
                      {k: larger(v, b.grads.get(k)) for k, v in a.grads.items()},
                      buffers={k: larger(v, b.buffers.get(k)) for k, v in a.buffers.items()},
                      params={k: larger(v, b.params.get(k)) for k, v in a.params.items()})


def _perturbation(eager: list[StepResult], truth: list[StepResult], seed: int,
                  rounding: Sequence[StepResult | None] = ()) -> Callable[[int, str, torch.Tensor], torch.Tensor]:
    """Gradients moved, element by element with random signs, by as much as eager's own are off the truth
    there.

    After the first optimizer step a correct engine's parameters differ from eager's by rounding, and
    every later value re-rolls its own rounding from there; an optimizer can also amplify a gradient's
    rounding (Adam's update of an element whose gradient is near zero turns on its sign). Eager
    trained again, in its own dtype, on gradients moved that much shows how far such an engine may
    drift from eager, value by value: the auto tolerance adds it (``DRIFT_RUNS`` samples, the larger)."""
    generator = torch.Generator().manual_seed(seed)

    def perturb(step: int, name: str, grad: torch.Tensor) -> torch.Tensor:
        own, true = eager[step].grads.get(name), truth[step].grads.get(name)
        if own is None or true is None:
            return torch.zeros_like(grad)
        off = (own.double() - true.to(own.device)).abs()
        estimate = rounding[step] if step < len(rounding) else None
        estimated = estimate.grads.get(name) if estimate is not None else None
        if isinstance(estimated, torch.Tensor) and estimated.shape == off.shape:  # a float64 check: eager is the truth
            off = torch.maximum(off, estimated.to(off.device))
        size = DRIFT_SCALE * off.to(grad)
        signs = torch.randint(0, 2, grad.shape, generator=generator, dtype=torch.int8).to(grad.device) * 2 - 1
        return signs.to(grad) * size
    return perturb


def _difference(moved: StepResult, truth: StepResult) -> StepResult:
    """``|moved - truth|`` value by value (0 where a value is missing)."""
    def diff(a: Any, b: Any) -> Any:
        return (a - b).abs() if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            else None
    return StepResult(pytree.tree_map(diff, moved.outputs, truth.outputs), diff(moved.loss, truth.loss),
                      {k: diff(v, truth.grads.get(k)) for k, v in moved.grads.items()},
                      buffers={k: diff(v, truth.buffers.get(k)) for k, v in moved.buffers.items()},
                      params={k: diff(v, truth.params.get(k)) for k, v in moved.params.items()})


def call_runner(call: Callable[[Job], Any], runner_name: str, job: Job, doing: str) -> Any:
    """``call(job)``; an exception that is not pipecheck's own becomes an EngineError naming the runner."""
    try:
        return call(job)
    except PipecheckError:
        raise
    except Exception as err:
        raise EngineError(f"runner {runner_name!r} failed to {doing}: {type(err).__name__}: {err}",
                          engine=runner_name) from err


def runner_steps(train: Callable[[Job], Any], runner_name: str, job: Job) -> list[StepResult]:
    results = call_runner(train, runner_name, job, "train")
    results = list(results) if isinstance(results, (list, tuple)) else results
    steps = job.training.steps
    if not isinstance(results, list) or len(results) != steps or not all(isinstance(r, StepResult) for r in results):
        got = f"{len(results)} items" if isinstance(results, list) else type(results).__name__
        raise EngineError(f"runner {runner_name!r}.train(job) returned {got}; it must return a list of "
                          f"{plural(steps, 'pc.StepResult')}, one per optimizer step (grads before the optimizer, "
                          "params after it).", engine=runner_name)
    return results


def training_batches(batches: Sequence[Inputs], targets: Sequence[Any]) -> tuple[Batch, ...]:
    """The runner's batches: copies eager never wrote into (a forward may write into its input)."""
    fresh = [b.unspoiled() for b in batches]
    return tuple(Batch(b.args, dict(b.kwargs), target) for b, target in zip(fresh, targets))


def check_batch_sizes(batches: Sequence[Inputs], job: Job) -> None:
    """Under the mean convention every micro-batch of every replica holds as many samples: say which
    batch does not divide, in the user's own numbers (not the product the splitting sees)."""
    n, d = job.n_microbatches, job.training.data_parallel
    if job.training.loss_reduction != "mean" or d == 1:
        return
    for i, inputs in enumerate(batches):
        for leaf in pytree.tree_leaves((inputs.args, inputs.kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] % (n * d):
                raise InputError(f"batch {i} has batch size {leaf.shape[0]} on dim 0, which data_parallel={d} "
                                 f"replicas of n_microbatches={n} cannot share equally, as the mean of micro-batch "
                                 f"losses needs. Fix: a batch size that is a multiple of {n * d}, or "
                                 "loss_reduction='sum' / 'token_mean', which weigh micro-batches of any size.")


def compare_steps(pipe: Pipe, job: Job, results: list[StepResult], eager: list[StepResult],
                  truth: list[StepResult], tolerance: ToleranceLike, check_grads: bool,
                  drift: Sequence[StepResult | None] = ()) -> tuple[list[Row], dict[str, str], str]:
    """Every row of every step, hints, and where the runs part (in words; "" when they do not).
    ``drift``: per step, how far a correct engine may be off the truth through the optimizer."""
    rows: list[Row] = []
    by_step: list[list[Row]] = []
    drifts = list(drift) + [None] * (len(results) - len(drift))
    for t, (result, e, r) in enumerate(zip(results, eager, truth)):
        prefix = f"step {t}: " if len(results) > 1 else ""
        step_rows = _step_rows(pipe, job, prefix, result, e, r, tolerance, check_grads, drifts[t])
        by_step.append(step_rows)
        rows += step_rows
    rows = judge_power(rows)
    judged = iter(rows)
    by_step = [[next(judged) for _ in step] for step in by_step]
    hints: dict[str, str] = {}
    located = ""
    for t, step_rows in enumerate(by_step):
        failing = [row for row in step_rows if not row.ok]
        if not failing:
            continue
        kind = min((row.kind for row in failing), key=ORDER.index)
        first = [row.name for row in failing if row.kind == kind]
        before = "" if t == 0 else " (step 0 matches)" if t == 1 else f" (steps 0 to {t - 1} match)"
        located = (f"first divergence: optimizer step {t} of {len(by_step)}{before}, in its {_KIND_WORDS[kind]}: "
            + ", ".join(first[:3]) + (f" and {len(first) - 3} more" if len(first) > 3 else ""))
        _hint_step(t, step_rows, results, truth, job, hints)
        break
    return rows, hints, located


_KIND_WORDS = {"outputs": "outputs", "loss": "loss", "grads": "gradients before the optimizer",
               "params": "parameters after the optimizer step", "buffers": "buffers"}


def _step_rows(pipe: Pipe, job: Job, prefix: str, result: StepResult, eager: StepResult, truth: StepResult,
               tolerance: ToleranceLike, check_grads: bool, drift: StepResult | None = None) -> list[Row]:
    last = (pipe.num_stages - 1,)
    rows = []
    none = StepResult(None, None, {})
    drift = drift or none
    drift_outputs = pytree.tree_leaves(drift.outputs) if drift.outputs is not None else []
    g = job.training.accumulation_steps
    for a in range(g):  # an accumulating step's outputs: one per schedule step
        suffix = f" (schedule step {a} of {g})" if g > 1 else ""
        tested = result.outputs if g == 1 else result.outputs[a] if isinstance(result.outputs, (tuple, list)) \
            and len(result.outputs) == g else None
        got = {output_name(path): leaf for path, leaf in pytree.tree_flatten_with_path(tested)[0]}
        expected, true_outputs = (eager.outputs, truth.outputs) if g == 1 else (eager.outputs[a], truth.outputs[a])
        leaves = pytree.tree_flatten_with_path(expected)[0]
        drifted = drift_outputs[a * len(leaves):(a + 1) * len(leaves)] if g > 1 else drift_outputs
        for i, ((path, leaf), true) in enumerate(zip(leaves, pytree.tree_leaves(true_outputs))):
            name = output_name(path)
            row = compare(prefix + name + suffix, got.get(name), leaf, true, tolerance, last, kind="outputs",
                          truth_error=drifted[i] if i < len(drifted) else None)
            if tested is None:  # accumulating: the runner's outputs are not one per schedule step
                row = dataclasses.replace(row, note=f"missing: with accumulation_steps={g} a runner returns its "
                                                    f"outputs as a tuple of {g}, one per schedule step")
            rows.append(row)
    rows.append(compare(prefix + "loss", result.loss, eager.loss, truth.loss, tolerance, last, kind="loss",
                        truth_error=drift.loss))
    if check_grads:
        for fqn, grad in eager.grads.items():
            stages = pipe.param_stages(fqn)
            moved = drift.grads.get(fqn)
            rows.append(compare(f"{prefix}grad {fqn}", result.grads.get(fqn), grad, truth.grads[fqn], tolerance,
                                stages, kind="grads", truth_error=moved))
            for stage, replica in sorted(result.replica_grads.get(fqn, {}).items()):
                rows.append(compare(f"{prefix}grad {fqn} (replica in stage {stage})", replica, grad,
                                    truth.grads[fqn], tolerance, (stage,), kind="grads", truth_error=moved))
        unexpected_grads(result.grads, eager.grads, f"{prefix}grad ", pipe.param_stages, rows, {}, "")  # must be 0
    for fqn, param in eager.params.items():
        stages, moved = pipe.param_stages(fqn), drift.params.get(fqn)
        rows.append(compare(f"{prefix}param {fqn}", result.params.get(fqn), param, truth.params[fqn], tolerance,
                            stages, kind="params", truth_error=moved))
        for stage, replica in sorted(result.replica_params.get(fqn, {}).items()):
            rows.append(compare(f"{prefix}param {fqn} (replica in stage {stage})", replica, param,
                                truth.params[fqn], tolerance, (stage,), kind="params", truth_error=moved))
    for fqn, copies in sorted(result.dp_grads.items()) if check_grads else ():
        for (dp_rank, stage), copy_ in sorted(copies.items()):
            if fqn in eager.grads:
                rows.append(compare(f"{prefix}grad {fqn} (dp rank {dp_rank}, stage {stage})", copy_, eager.grads[fqn],
                                    truth.grads[fqn], tolerance, (stage,), kind="grads",
                                    truth_error=drift.grads.get(fqn)))
    for fqn, copies in sorted(result.dp_params.items()):
        for (dp_rank, stage), copy_ in sorted(copies.items()):
            if fqn in eager.params:
                rows.append(compare(f"{prefix}param {fqn} (dp rank {dp_rank}, stage {stage})", copy_,
                                    eager.params[fqn], truth.params[fqn], tolerance, (stage,), kind="params",
                                    truth_error=drift.params.get(fqn)))
    for fqn, buffer in eager.buffers.items() if job.training.data_parallel == 1 else ():
        if fqn in result.buffers:
            rows.append(compare(f"{prefix}buffer {fqn}", result.buffers[fqn], buffer, truth.buffers[fqn], tolerance,
                                pipe.buffer_stages(fqn), kind="buffers", truth_error=drift.buffers.get(fqn)))
    return rows


def _scaling(test: torch.Tensor, truth: torch.Tensor, job: Job) -> str | None:
    """A gradient off by a factor that accumulation, data parallelism or the micro-batch count explains
    (every explanation of that factor, when several give it)."""
    g, n, d = job.training.accumulation_steps, job.n_microbatches, job.training.data_parallel
    candidates = ((1 / g, f"divided by accumulation_steps={g} once too often"),
                  (float(g), f"not divided by accumulation_steps={g}"),
                  (float(d), f"not divided by data_parallel={d} (the replicas' gradients summed, not averaged)"),
                  (1 / d, f"divided by data_parallel={d} once too often"),
                  (1 / (g * n * d), "divided by the micro-batch count once too often"),
                  (float(g * n * d), "summed over micro-batches where the convention averages"))
    for factor in dict.fromkeys(factor for factor, _ in candidates):
        if factor != 1.0 and matches(test, truth * factor):
            whys = [why for other, why in candidates if other == factor]
            return (f"gradient scaling: the gradient is {factor:g} x the truth, as if each schedule step's loss were "
                    f"{', or '.join(whys)} (loss_reduction={job.training.loss_reduction!r})")
    return None


def _param_fqn(name: str) -> str:
    """``step 2: param emb.weight (replica in stage 1)`` -> ``emb.weight``."""
    return name.split("param ", 1)[1].split(" (", 1)[0]


def _unsummed_tie(result: StepResult, truth: StepResult, fqn: str) -> bool:
    """Whether ``fqn`` is a tied parameter whose replicas' gradients sum to the truth: each replica kept its
    own stage's share."""
    replicas = result.replica_grads.get(fqn, {})
    if len(replicas) < 2 or fqn not in truth.grads or any(g.shape != truth.grads[fqn].shape for g in replicas.values()):
        return False
    return matches(torch.stack([g.detach().cpu() for g in replicas.values()]).sum(0), truth.grads[fqn])


def _hint_step(t: int, rows: list[Row], results: list[StepResult], truth: list[StepResult], job: Job,
               hints: dict[str, str]) -> None:
    """Hints on the first failing step's rows (computed only on failure, never changing a verdict)."""
    grads_fail = [row for row in rows if row.kind == "grads" and not row.ok and "(replica" not in row.name]
    params_fail = [row for row in rows if row.kind == "params" and not row.ok]
    forward_fails = any(not row.ok for row in rows if row.kind in ("outputs", "loss"))
    outputs_fail = [row for row in rows if row.kind == "outputs" and not row.ok]
    if job.training.random_seed is not None and outputs_fail:  # the runner's draws of another micro-batch?
        test = results[t].outputs if job.training.accumulation_steps == 1 else results[t].outputs[0]
        hint = wrong_draws_hint(job, t, test, truth[t - 1] if t > 0 else None)
        if hint is not None:
            hints[outputs_fail[0].name] = hint
            return
    # a tie whose replicas each hold their own stage's share (torch's own bug) is no recompute's fresh random
    # numbers: left to the one-step check's hint (train_locate), "tied parameter not synchronised"
    grads_fail = [row for row in grads_fail if not _unsummed_tie(results[t], truth[t], row.name.split("grad ", 1)[1])]
    if job.training.dropout and grads_fail and not forward_fails:
        ops = job.training.dropout
        named = "; ".join(ops[:3]) + (f"; and {len(ops) - 3} more" if len(ops) > 3 else "")
        hints[grads_fail[0].name] = (
            f"outputs and loss match and gradients do not, in a model that draws random numbers ({named}): a "
            "backward that recomputes a forward with fresh random numbers gives this (activation recomputation "
            "with torch.utils.checkpoint(..., preserve_rng_state=False), or a stage recomputed outside "
            "pc.randomness.drawing with the forward's stage and micro-batch)")
        return
    for row in grads_fail:
        fqn = row.name.split("grad ", 1)[1]
        test = results[t].grads.get(fqn)
        if not isinstance(test, torch.Tensor):
            continue
        if fqn not in truth[t].grads:  # a gradient eager does not have (its row: "zero expected")
            hints[row.name] = ("eager computes no gradient here (a frozen or unused parameter, or not an original "
                               "FQN: runners key gradients by model.named_parameters() names)")
            continue
        if t > 0 and all(fqn in step.grads for step in truth[:t + 1]) and matches(
                test, sum((step.grads[fqn] for step in truth[:t + 1]), torch.zeros_like(truth[t].grads[fqn]))):
            hints[row.name] = (f"gradient holds steps 0..{t}'s gradients summed: gradients are not zeroed between "
                               "optimizer steps (zero them after each optimizer step, or on the first schedule "
                               "step of the next)")
            continue
        hint = _scaling(test, truth[t].grads[fqn], job) or diagnose_grad(test, truth[t].grads[fqn], job.n_microbatches)
        if hint:
            hints[row.name] = hint
    frozen_fqns = job.frozen_params()
    frozen = [row for row in params_fail if _param_fqn(row.name) in frozen_fqns]
    for row in frozen:
        if row.note:  # missing from the runner's result: the row says so, no hint
            continue
        hints[row.name] = ("a frozen parameter (requires_grad=False) changed in the optimizer step: the engine trains "
                           "it (it set requires_grad on every parameter it wraps, or steps parameters without a "
                           "gradient of the model's)")
    params_fail = [row for row in params_fail if row not in frozen]
    if params_fail and not grads_fail:
        replicas = [row for row in params_fail if "(replica in stage" in row.name]
        first = params_fail[0]
        if replicas and len(replicas) == len(params_fail):
            hints[first.name] = ("only replicas of tied parameters differ after the optimizer step, with gradients "
                                 "that match: the optimizer does not update every replica alike (every stage holding "
                                 "a tied parameter must step it)")
        else:
            hints[first.name] = ("gradients before the optimizer match and parameters after it do not: the "
                                 "optimizer step differs (clipping's norm over the stages, a learning rate, a "
                                 "parameter left out of the optimizer)")
