"""``assert_equivalent``: does a pipelined run compute what the eager model computes?

    report = pc.assert_equivalent(model, (x,), split_spec=spec, n_microbatches=4,
                                  runner="reference")

The model is built once and split once; the inputs are bound, cast and
copied once. The eager model runs per micro-batch (as a pipeline sees it) in
the check's dtype, then the same model in float64 as ground truth; the runner
runs the same job; every output leaf, the loss, every parameter gradient and
the gradients of inputs that require grad are compared. Raises
:class:`EquivalenceError` with the failure table, or returns the :class:`Report`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from pipecheck._check.anchor import eager_anchor, low_precision
from pipecheck._check.compare import compare_all
from pipecheck._check.determinism import check_deterministic, refuse_random
from pipecheck._check.eager import buffers_kept, check_finite, eager_step, result_dtype
from pipecheck._check.in_driver import in_driver
from pipecheck._check.localise import ReferenceByMicrobatch, locate, not_located
from pipecheck._check.numerics import POWER_LIMIT, ToleranceLike, check_tolerance, compared_on
from pipecheck._check.placement import Placement
from pipecheck._check.random_ops import with_randomness
from pipecheck._check.report import Report, percent
from pipecheck._check.rounding import rounding_excused
from pipecheck._check.training import check_training, refuse_one_call
from pipecheck._check.truth64 import float64_truth
from pipecheck._core.precision import Precision, resolve_precision
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, OptimizerFactory, Training
from pipecheck._runners.arguments import check_arguments, plain, training_arguments
from pipecheck._runners.job import Job, Runner
from pipecheck._runners.registry import RUNNERS, runner_named
from pipecheck._split.inputs import prepare_inputs
from pipecheck._split.model_factory import ModelFactory, refuse_unreproducible, seeded
from pipecheck._split.model_outputs import left_out_notes
from pipecheck._split.reuse import Hit, split_reusing
from pipecheck._split.trace import check_tracer
from pipecheck._split.traced import SplitSpec
from pipecheck._world.spawn import refuse_unguarded_main
from pipecheck._world.world import pickle_problem
from pipecheck.errors import (
    EngineError,
    EquivalenceError,
    InputError,
    PipecheckError,
    PowerError,
    RankFailedError,
    RankTimeoutError,
    SplitError,
    TraceError,
    first_line,
    plural,
)
from pipecheck.losses import LossFn, projection_loss
from pipecheck.policies import Policy

if TYPE_CHECKING:
    from pipecheck._world.world import World


def resolve_runner(runner: Any) -> tuple[str, Runner]:
    """``(name, runner)`` for a built-in runner's name or a user's callable."""
    entry = runner_named(runner)
    if entry is not None:
        if entry.on_world:
            refuse_unguarded_main()  # before the eager runs: a rank re-importing an unguarded script stops here
        return str(runner).strip(), entry.load()
    if callable(runner):
        return getattr(runner, "__name__", type(runner).__name__), runner
    raise InputError(f"runner={runner!r} is not known. Fix: use one of {list(RUNNERS)} or a callable "
                     "runner(job: pc.Job) -> pc.StepResult.")


def assert_equivalent(
    model: nn.Module | Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
    split_spec: SplitSpec | None = None, policy: Policy | None = None, loss_fn: LossFn | None = None,
    target: Any = None, n_microbatches: int = 1, schedule: str = "1f1b", world_size: int | None = None,
    runner: Any = "distributed", device: str | None = None, dtype: torch.dtype | None = None,
    tolerance: ToleranceLike = "auto", check_grads: bool = True, seed: int = 0, tracer: str = "auto",
    stages_per_rank: int = 1, timeout: float | None = None, world: World | None = None,
    trace_path: str | None = None, steps: int = 1, optimizer: OptimizerFactory | None = None,
    clip_grad_norm: float | None = None, accumulation_steps: int = 1, loss_reduction: str = "mean",
    ignore_index: int = -100, batches: Sequence[Batch] | None = None, data_parallel: int = 1,
    precision: Precision | None = None,
) -> Report:
    """Check that ``runner`` computes the eager model's outputs, loss and gradients.

        pc.assert_equivalent(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING},
                             n_microbatches=4, runner="reference")

    ``world`` runs a distributed runner on that World (default: a shared one of
    ``world_size`` ranks); ``trace_path`` writes its timeline. ``timeout`` (seconds a step) stops a hang:
    the World's ranks, naming the rank that hung; a runner of your own, which runs in this process,
    naming the line it was stuck at (None: a World's default; your runner is waited for).

    Training (docs/training.md): ``steps`` optimizer steps of ``optimizer(params)`` (a factory; with
    ``clip_grad_norm``), each over ``accumulation_steps`` schedule steps, on ``batches`` (one
    ``pc.Batch`` per schedule step; default: ``args`` every time); ``loss_reduction`` "mean" (of
    micro-batch losses), "token_mean" (per-token losses over the valid tokens of the whole optimizer
    step, ``ignore_index`` skipped) or "sum"; ``data_parallel`` pipeline replicas, each on its
    shard of every batch. The runner needs a ``train`` method.

    ``precision`` (a :class:`pipecheck.Precision`, docs/use.md#low-precision): the parameters' dtype
    (as ``dtype``), gradients summed over micro-batches in float32, or ``torch.autocast``, run the same way
    by eager, the reference and the runner. Raises
    :class:`pipecheck.EquivalenceError` (an AssertionError) with a table naming
    every failing tensor, or returns the :class:`pipecheck.Report`.
    """
    tolerance = check_tolerance(tolerance)
    check_tracer(tracer)
    check_arguments("assert_equivalent", model=model, args=args, kwargs=kwargs, split_spec=split_spec,
                    policy=policy, loss_fn=loss_fn, target=target, n_microbatches=n_microbatches,
                    world_size=world_size, stages_per_rank=stages_per_rank, seed=seed, check_grads=check_grads,
                    timeout=timeout, world=world, trace_path=trace_path)
    training, given_batches = training_arguments(
        "assert_equivalent", steps=steps, accumulation_steps=accumulation_steps, optimizer=optimizer,
        clip_grad_norm=clip_grad_norm, loss_reduction=loss_reduction, ignore_index=ignore_index, batches=batches,
        loss_fn=loss_fn, data_parallel=data_parallel)
    n_microbatches, world_size, stages_per_rank, seed, check_grads, timeout = map(
        plain, (n_microbatches, world_size, stages_per_rank, seed, check_grads, timeout))
    runner_name, run = resolve_runner(runner)
    if runner_named(runner) is None:  # a user's runner runs in this process: the timeout stops it there
        run = in_driver(run, runner_name, timeout)
    _refuse_untravelled(runner, training)
    if not training.plain or given_batches:
        refuse_one_call(run, runner_name, training)  # before any work
    precision = resolve_precision(dtype, precision)
    _refuse_unfollowed(precision, run, runner_name, training, given_batches)
    check = functools.partial(_check, model, args, kwargs, split_spec, policy, loss_fn, target, n_microbatches,
                              schedule, world_size, runner_name, run, device, precision, tolerance, check_grads, seed,
                              tracer, stages_per_rank, timeout, world, trace_path, training, given_batches)
    with _ONE_CHECK_AT_A_TIME:
        hits: list[Hit] = []
        try:
            return check(hits)
        except (EquivalenceError, EngineError, RankFailedError) as err:
            # A split reused from an earlier check whose graph no longer holds (what forward reads changed
            # where the reuse key cannot see it) fails any runner. The runner is never run again: a failure
            # on a graph that no longer holds is named as such, and the next check traces afresh.
            if not _timed_out(err):
                _refuse_stale(hits, model, f"{type(err).__name__}: {first_line(err)[:200]}", err)
            raise


def _timed_out(err: BaseException) -> bool:
    """Whether ``err`` is, or was caused by, a timeout (a World's, or a runner's in this process)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (RankTimeoutError, TimeoutError)):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _refuse_stale(hits: list[Hit], model: Any, failure: str, cause: BaseException | None = None) -> None:
    """A SplitError where the failing check ran on a split reused from an earlier check whose graph the model
    no longer traces to (traced again once, here)."""
    if not hits or hits[0].still_traced_the_same() is not False:
        return
    name = getattr(model, "__qualname__", None) or type(model).__name__
    raise SplitError(
        f"this check of {name} cut the model along the graph an earlier check of it in this process traced, and "
        f"failed ({failure}); traced again now, the model gives another graph: something its forward reads "
        "changed since that check where the reuse could not see it (a mutable global, an attribute of another "
        "module or object). The runner ran on the earlier graph, so this failure says nothing about the "
        "pipeline, and it is not run a second time. Fix: run the check again: the earlier graph is forgotten, "
        "and the next check traces the model afresh.") from cause


# One check at a time per process: a check seeds and restores torch's global RNG around its eager
# runs, and two threads doing so at once draw from each other's streams (measured: 6 of 50
# reference checks in two threads failed, blaming the model).
_ONE_CHECK_AT_A_TIME = threading.RLock()


def _check(model: Any, args: Any, kwargs: Mapping[str, Any] | None, split_spec: SplitSpec | None,
           policy: Policy | None, loss_fn: LossFn | None, target: Any, n_microbatches: int, schedule: str,
           world_size: int | None, runner_name: str, run: Runner, device: str | None, precision: Precision,
           tolerance: ToleranceLike, check_grads: bool, seed: int, tracer: str, stages_per_rank: int,
           timeout: float | None, world: World | None, trace_path: str | None, training: Training,
           given_batches: tuple[Batch, ...], hits: list[Hit]) -> Report:
    """One check; ``hits``: where a split reused from an earlier check is noted."""
    timings: dict[str, float] = {}
    started = time.perf_counter()
    dtype = precision.dtype

    @contextmanager
    def clock(phase: str) -> Iterator[None]:
        begun = time.perf_counter()
        try:
            yield
        finally:
            timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - begun

    factory = ModelFactory(model, dtype=dtype, device=device, seed=seed)
    with clock("build_s"):
        built = factory()
        inputs = prepare_inputs(built, args, kwargs, target, dtype=dtype, device=device)
    with clock("split_s"):  # the stages share the built model's parameters: no second copy
        try:
            pipe = split_reusing(factory, built, inputs.args, inputs.kwargs, split_spec=split_spec, policy=policy,
                                 tracer=tracer, hits=hits)
        except TraceError as untraced:  # a random model (a Generator argument: torch < 2.13 cannot trace one)
            refuse_random(built, inputs, n_microbatches, seed, first_line(untraced).rstrip(":"))  # said first
            raise
    check_split = getattr(run, "check_split", None)
    if check_split is not None:  # a runner's refusal of this split, before any eager work
        check_split(pipe)
    training = with_randomness(training, pipe, run, runner_name, seed)  # random ops: drawn by the contract
    if not training.plain or given_batches:
        job = Job(model=factory, args=inputs.args, kwargs=inputs.kwargs, split_spec=split_spec, policy=policy,
                  tracer=tracer, loss_fn=loss_fn, target=inputs.target, n_microbatches=n_microbatches,
                  schedule=schedule, world_size=world_size, stages_per_rank=stages_per_rank,
                  device=str(device or "cpu"), timeout=timeout, world=world, trace_path=trace_path, pipe=pipe,
                  training=training, batches=given_batches)
        report = check_training(run, runner_name, job, built, inputs, tolerance, check_grads, seed, clock,
                                dtype, device)
        report.timings.update(timings, total_s=time.perf_counter() - started)
        report.notes[:0] = left_out_notes(built)
        return _verdict(report, tolerance, factory)
    initial_buffers = {name: b.detach().clone() for name, b in built.named_buffers()}
    place = Placement.of(device)  # finished results off the accelerator where it is tight
    with clock("eager_s"), seeded(seed), buffers_kept(built), place.measuring():  # the user's RNG: untouched
        eager, target_used = eager_step(built, inputs, loss_fn, n_microbatches, check_grads, precision=precision)
    eager = place.keep(eager, sum(p.nbytes for p in built.parameters()))
    inputs = inputs.unspoiled()
    with clock("probe_s"):  # two forwards of one micro-batch
        check_deterministic(built, inputs, n_microbatches, seed)
    with clock("fp64_s"):  # built as it was after
        ref64 = place.keep(float64_truth(built, inputs, loss_fn or projection_loss, target_used, n_microbatches,
                                         check_grads, seed, result_dtype(eager)))
    check_finite(eager)

    inputs = inputs.unspoiled()
    job = Job(model=factory, args=inputs.args, kwargs=inputs.kwargs, split_spec=split_spec, policy=policy,
              tracer=tracer, loss_fn=loss_fn or projection_loss, target=target_used,
              n_microbatches=n_microbatches, schedule=schedule, world_size=world_size,
              stages_per_rank=stages_per_rank, device=str(device or "cpu"), timeout=timeout, world=world,
              trace_path=trace_path, pipe=pipe, precision=precision)
    with clock("runner_s"):
        result = place.keep(_run(run, runner_name, dataclasses.replace(job, kwargs=dict(job.kwargs))))
    anchored: ToleranceLike = tolerance
    anchor_notes: list[str] = []
    if tolerance == "auto" and low_precision(eager, precision):  # float64 is too far from eager to anchor on
        with clock("anchor_s"):
            try:
                anchored, anchor_notes = eager_anchor(built, inputs, dataclasses.replace(job, **_fresh(inputs)),
                                                      eager, result, ref64, seed, check_grads)
            except PipecheckError:
                raise
            except Exception as err:  # measuring the noise failed (out of memory): the float64 anchor, said so
                anchored, anchor_notes = tolerance, [
                    f"the legitimate noise of this low-precision check could not be measured ({type(err).__name__}: "
                    f"{first_line(err)[:160]}): it is anchored on float64"]
    left_out = left_out_notes(built)  # outputs no runner hands back (a generation cache): said, not compared
    del built
    clean = inputs.unspoiled()  # hints re-run the reference: never on inputs the runner wrote into
    job = dataclasses.replace(job, args=clean.args, kwargs=clean.kwargs)
    reference = ReferenceByMicrobatch(job)  # run only on failure, by the hints and the locating step
    with clock("compare_s"), compared_on(place.device if place.host else None):
        rows, hints, notes = compare_all(pipe, job, result, eager, ref64, anchored, check_grads, initial_buffers,
                                         reference)
    timings["total_s"] = time.perf_counter() - started
    report = Report(runner_name, rows, hints, str(anchored),
                    str(result_dtype(eager)).replace("torch.", ""), n_microbatches, pipe.num_stages, timings,
                    left_out + anchor_notes + notes, pipe.tracer, precision=precision.describe())
    if not report.ok and tolerance == "auto" and anchored == tolerance:  # anchored on float64: its own rounding
        with clock("rounding_s"):  # a re-ordering of the same math moves a failing row as far: not evidence
            report.rows, excused = rounding_excused(report.rows, job, seed)
        report.notes.extend(excused)
    _judge_blind(report, tolerance)
    if not report.ok:
        # a factory that builds other weights on each call: no runner can match, whatever the table says
        refuse_unreproducible(factory, f"{len(report.failures)} of {len(report.rows)} tensors failed")
        _refuse_stale(hits, model, f"{len(report.failures)} of {len(report.rows)} tensors failed")  # before locating
        with clock("locate_s"):
            try:
                report.first_divergence, report.located = locate(
                    lambda: dataclasses.replace(job, **_fresh(inputs)), run, runner_name,
                    {row.kind for row in report.failures}, reference)
            except Exception as err:  # a diagnosis that fails (out of memory) never hides the verdict
                report.located = not_located("locating it failed", err)
        report.timings["locate_s"] = timings["locate_s"]
        raise EquivalenceError(report.failure_text(), report)
    return report


def _refuse_unfollowed(precision: Precision, run: Runner, runner_name: str, training: Training,
                       given_batches: tuple[Batch, ...]) -> None:
    """Mixed precision (float32 sums, autocast) asked of a runner that does not say it follows it, or of a
    training check: refused before any work."""
    if not precision.mixed:
        return
    if not training.plain or given_batches:
        raise InputError(f"pc.Precision({precision.describe()}) is checked one step at a time for now: a training "
                         f"check ({training.describe()}) runs in the parameters' dtype alone. Fix: check one step "
                         "with precision=..., and train with dtype=... .")
    if not getattr(run, "follows_precision", False):
        raise InputError(
            f"runner {runner_name!r} does not say it runs as pc.Precision({precision.describe()}) asks: a check "
            "would compare it with eager run that way, and blame it for what its engine was never set to do. Fix: "
            "runner='reference' or runner='distributed'; for your own runner, run each forward under "
            "job.precision.forward(device) and sum each parameter's micro-batch gradients in "
            "job.precision.grad_accumulation, then set its attribute follows_precision = True.")


def _refuse_untravelled(runner: Any, training: Training) -> None:
    """An optimizer that cannot travel to a World's ranks, refused before any eager work."""
    entry = runner_named(runner)
    if entry is None or not entry.on_world or training.optimizer is None:
        return
    problem = pickle_problem(training.optimizer)
    if problem is not None:
        name = getattr(training.optimizer, "__qualname__", type(training.optimizer).__name__)
        raise InputError(f"optimizer {name!r} cannot be pickled to send it to the ranks of runner {str(runner)!r} "
                         f"({type(problem).__name__}: {problem}). Fix: define it as a top-level function of an "
                         "importable module, e.g. def sgd(params): return torch.optim.SGD(params, lr=0.1).")


def _judge_blind(report: Report, tolerance: ToleranceLike) -> None:
    """A passing check whose rows could hide a gross error certifies nothing: PowerError; a failing
    one says which of its passing rows certify nothing."""
    if tolerance == "auto" and report.blind:  # rows that pass whatever the runner did there
        if report.ok:
            raise PowerError(report.power_text(), report)
        report.notes.append(f"{plural(len(report.blind), 'tensor')} could hide an error of {percent(POWER_LIMIT)} "
                            f"or more ({report.dtype} eager is itself far from float64 there): their passing rows "
                            "certify nothing; err.report.blind lists them, dtype=torch.float64 checks them")


def _verdict(report: Report, tolerance: ToleranceLike, factory: ModelFactory) -> Report:
    """A training check's report returned, or raised as an EquivalenceError."""
    _judge_blind(report, tolerance)
    if not report.ok:
        refuse_unreproducible(factory, f"{len(report.failures)} of {len(report.rows)} tensors failed")
        raise EquivalenceError(report.failure_text(), report)
    return report


def _fresh(inputs: Any) -> dict[str, Any]:
    """The job's inputs as the user gave them, copied again (a runner may have written into the last copy)."""
    clean = inputs.unspoiled()
    return {"args": clean.args, "kwargs": dict(clean.kwargs)}


def _run(run: Runner, runner_name: str, job: Job) -> StepResult:
    try:  # not through call_runner: a World's start-up error keeps its traceback short (tests/world/test_scripts.py)
        result = run(job)
    except PipecheckError:
        raise
    except Exception as err:
        raise EngineError(f"runner {runner_name!r} failed to run the job: {type(err).__name__}: {err}",
                          engine=runner_name) from err
    if not isinstance(result, StepResult):
        raise EngineError(f"runner {runner_name!r} returned {type(result).__name__}; a runner must return "
                          "pc.StepResult(outputs, loss, grads).", engine=runner_name)
    return result
