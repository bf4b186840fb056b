"""What the built-in runners share, and the "reference" runner.

    world = world_for(job, n_ranks=4, engine="pipecheck")   # the job's World, or a shared one
    results = run_on_world(world, rank_step, spec, job)      # names the part of job pickle refuses
    grads, replicas = merge_stage_grads(stage_grads, pipe.tied_groups)
    available_runners()                                     # the built-in ones, DeepSpeed's if installed, ...

Built-in runners by name (one table: :mod:`pipecheck._runners.registry`): "reference"
(:class:`DetachExecutor` in this process), "distributed" (pipecheck's runtime on a World), "torch"
(torch.distributed.pipelining on a World), and the optional ones whose engine is a separate install
("deepspeed", "torchtitan"). The engines on a World share one driver skeleton
(:mod:`pipecheck._runners.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from pipecheck._core.result import StepResult
from pipecheck._core.torch_versions import TESTED_TORCH, is_tested, tested_note
from pipecheck._runners import registry
from pipecheck._runners.job import Job
from pipecheck._runtime.boundaries import recording
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import Pipe, TiedGroup
from pipecheck._split.stage_build import builds_alone, remove_stage_state, write_stage_state
from pipecheck._world.world import World, pickle_problem
from pipecheck.errors import (
    AdapterError,
    EngineError,
    InputError,
    RankError,
    RankFailedError,
    RankTimeoutError,
    TaskPickleError,
    WorldError,
    first_line,
    plural,
)


def available_runners() -> list[str]:
    """Every built-in runner's name whose engine is installed here."""
    return registry.available()


def run_reference(job: Job) -> StepResult:
    """pipecheck's single-process reference: DetachExecutor on the job's split (the check's own, its
    buffers put back after: a step changes only buffers, never parameters)."""
    with job.structure().buffers_restored() as pipe, \
            (recording(pipe, job.boundaries) if job.boundaries is not None else contextlib.nullcontext()):
        return DetachExecutor(pipe, precision=job.precision).step(job.args, job.kwargs, loss_fn=job.loss_fn,
                                                                  target=job.target, n_microbatches=job.n_microbatches)


def ranks_needed(n_stages: int, stages_per_rank: int) -> int:
    """Ranks that hold ``n_stages`` stages, ``stages_per_rank`` each (rounded up)."""
    return -(-n_stages // stages_per_rank)


def world_for(job: Job, n_ranks: int, engine: str) -> World:
    """The World ``job`` runs on: its own, or the process's shared one of ``n_ranks`` ranks.

    A World or ``world_size`` that does not hold the split's stages is an InputError naming the cut
    that would fit.
    """
    world = job.world
    if world is not None and job.world_size is not None and job.world_size != world.world_size:
        raise InputError(f"world_size={job.world_size} but the given World has {world.world_size} ranks. "
                         "Fix: pass a World of that size, or drop world_size.")
    asked = world.world_size if world is not None else job.world_size if job.world_size is not None else n_ranks
    if asked != n_ranks:
        have = "the World has" if world is not None else "world_size is"
        fits = asked * job.stages_per_rank
        raise InputError(
            f"{engine} needs {plural(n_ranks, 'rank')} but {have} {asked}: the split's stages, "
            f"{job.stages_per_rank} per rank, take {plural(n_ranks, 'rank')}. Fix: cut the model into "
            f"{plural(fits, 'stage')} (pipe_split() markers, split_spec or "
            f"policies.balanced_params({fits})), or use {plural(n_ranks, 'rank')} "
            f"(World({n_ranks}) / world_size={n_ranks})."
        )
    return world if world is not None else World.shared(n_ranks, job.device)


def run_on_world(world: World, fn: Callable[..., Any], spec: Any, job: Job) -> list[Any]:
    """``world.run(fn, spec)`` for ``job``; if pickle refuses, the error names the job's part it refused."""
    try:
        return world.run(fn, spec, timeout=job.timeout)
    except TaskPickleError as err:
        raise unpicklable_part(job) or err from err.__cause__


@contextlib.contextmanager
def stage_state_on(world: World, job: Job, pipe: Pipe, recipe: bytes | None) -> Iterator[str | None]:
    """The path of a file in ``world``'s folder holding ``pipe``'s tensors, for ranks that build only their
    own stages with the driver's values (pipecheck._split.stage_build), removed once the block ends, on a
    failure or a timeout too; None where the ranks build the whole model anyway (no recipe to cut along,
    a user's module, a torchrun World, a full disk)."""
    folder = world.folder() if recipe is not None and builds_alone(job.model) else None
    path = write_stage_state(pipe, folder) if folder is not None else None
    try:
        yield path
    finally:
        remove_stage_state(path)


def run_engine(world: World, fn: Callable[..., Any], spec: Any, job: Job,
               engine_failed: Callable[[WorldError], EngineError | AdapterError]) -> list[Any]:
    """:func:`run_on_world` for an engine's ranks: a job that cannot travel to them stays the
    TaskPickleError naming its part (not the engine's failure); any other World failure becomes
    ``engine_failed(err)``."""
    try:
        return run_on_world(world, fn, spec, job)
    except TaskPickleError:
        raise
    except WorldError as err:
        raise engine_failed(err) from err


_TOP_LEVEL = "a top-level function of an importable module (def ... at module level), not a lambda or a nested function"
_DATA = "tensors or plain data: live objects (open files, locks, generators, lambdas) cannot travel to the ranks"


def unpicklable_part(job: Job) -> TaskPickleError | None:
    """A TaskPickleError naming the first part of ``job`` that cannot be pickled (None if all can)."""
    source = job.model.source if isinstance(job.model, ModelFactory) else job.model
    if isinstance(source, nn.Module):
        model = f"the model ({type(source).__name__})"
        model_fix = f"pass a zero-argument factory that builds it, defined as {_TOP_LEVEL}"
    else:
        model, model_fix = f"the model factory {_name(source)!r}", f"define it as {_TOP_LEVEL}"
    parts: list[tuple[str, Any, str]] = [
        (model, source, model_fix),
        (f"loss_fn {_name(job.loss_fn)!r}", job.loss_fn, f"define it as {_TOP_LEVEL}"),
        ("target", job.target, f"pass {_DATA}"),
        *((f"args[{i}]", value, f"pass {_DATA}") for i, value in enumerate(job.args)),
        *((f"kwargs[{name!r}]", value, f"pass {_DATA}") for name, value in job.kwargs.items()),
        ("split_spec", job.split_spec, "map module FQNs to pc.SplitPoint values"),
        ("policy", job.policy, f"use a policy from pc.policies, or one defined as {_TOP_LEVEL}"),
        ("schedule", job.schedule, "pass a schedule name or a pipecheck.schedules.Schedule"),
        (f"optimizer {_name(job.training.optimizer)!r}", job.training.optimizer, f"define it as {_TOP_LEVEL}"),
        *((f"batches[{i}]", batch, f"pass {_DATA}") for i, batch in enumerate(job.batches)),
    ]
    for what, value, fix in parts:
        error = pickle_problem(value)
        if error is not None:
            return TaskPickleError(f"{what} cannot be pickled to send it to the ranks "
                                   f"({type(error).__name__}: {error}). Fix: {fix}.")
    return None


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def merge_stage_grads(stage_grads: Mapping[int, Mapping[str, torch.Tensor]], tied_groups: Sequence[TiedGroup]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
    """One gradient per FQN, from the lowest stage holding it, and every tied replica by stage.

    After pipecheck's all-reduce every replica holds the full gradient; an engine that never
    syncs them leaves each with its own share, and the check sees each replica.
    """
    grads: dict[str, torch.Tensor] = {}
    for s in sorted(stage_grads):
        for fqn, grad in stage_grads[s].items():
            grads.setdefault(fqn, grad)
    replicas = {group.fqn: {s: stage_grads[s][group.fqn] for s in group.stages
                            if group.fqn in stage_grads.get(s, {})} for group in tied_groups}
    return grads, {fqn: by_stage for fqn, by_stage in replicas.items() if by_stage}


def adapter_error(error: RankError, engine: str) -> AdapterError:
    """A rank's failure in pipecheck's own code calling an API of torch or ``engine`` that is not there."""
    where = f", during {error.action}" if error.action else ""
    fix = ("this torch is one pipecheck is tested on, so this is pipecheck's bug: report it with the "
           "traceback below" if is_tested(torch.__version__) else
           f"install a tested torch (pip install 'torch>={TESTED_TORCH[0]},<={TESTED_TORCH[-1]}.*'), or "
           "report this with the traceback below")
    return AdapterError(
        f"{error.summary} (in pipecheck's adapter for {engine}, {error.raised_at})\n"
        f"This is pipecheck's error, not a finding about {engine}: on rank {error.rank}, stage {error.stage}"
        f"{where}, pipecheck called an API that is missing or changed in this release. "
        f"{tested_note(torch.__version__)}. Fix: {fix}.\n"
        f"Traceback on rank {error.rank}:\n{error.traceback.rstrip()}",
        engine=engine, rank=error.rank, stage=error.stage, cause=error,
    )


def failure_error(error: RankError, engine: str, when: str, setting: str) -> EngineError | AdapterError:
    """A rank's failure inside ``engine`` as an EngineError: its message first (what a table cell
    shows), then the rank, stage and action, the settings and the rank's traceback. A failure of
    pipecheck's own adapter code is an :class:`AdapterError` instead."""
    if error.in_pipecheck:
        return adapter_error(error, engine)
    cause = error.causes[-1] if error.causes else (error.exc_type, error.message)
    message = first_line(cause[1])
    first = f"{cause[0].rsplit('.', 1)[-1]}: {message}" if message else cause[0]
    where = f", during {error.action}" if error.action else ""
    return EngineError(
        f"{first}\n{engine} failed on rank {error.rank}, stage {error.stage}, {when}{where}; {setting}.\n"
        f"Traceback on rank {error.rank}:\n{error.traceback.rstrip()}",
        engine=engine, rank=error.rank, stage=error.stage, cause=error,
    )


def engine_error(err: WorldError, engine: str, when: str, setting: str) -> EngineError | AdapterError:
    """A World failure while ``engine`` ran as an EngineError naming the engine, rank and stage."""
    if isinstance(err, RankFailedError):
        return failure_error(err.error, engine, when, setting)
    if isinstance(err, RankTimeoutError):
        return timeout_error(err, engine, f"stuck {when}", setting)
    return EngineError(f"{engine} could not run: {first_line(str(err))} ({setting})\n{err}", engine=engine,
                       rank=getattr(err, "rank", None), stage=getattr(err, "stage", None))


def timeout_error(err: RankTimeoutError, engine: str, stuck: str, setting: str) -> EngineError:
    """An engine's hang as an EngineError whose ``rank`` is the rank that hung (the World names it:
    the one the others wait for), not one waiting for it."""
    culprit = err.hung
    waiting = [rank for rank in err.ranks if rank != culprit]
    who = (f"rank {culprit} hung" + (f" ({', '.join(map(str, waiting))} waiting for it)" if waiting else "")
           if culprit is not None else f"rank(s) {', '.join(map(str, err.ranks))}")
    return EngineError(f"{engine} did not finish within {err.timeout} s ({who}, {stuck}; {setting}).\n{err}",
                       engine=engine, rank=culprit if culprit is not None else (err.ranks[0] if err.ranks else None))
