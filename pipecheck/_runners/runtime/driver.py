"""The "distributed" runner: pipecheck's stage runtime on a World, and ``pc.run_pipeline``.

    with pc.World(world_size=4) as world:
        res = pc.run_pipeline(world, make_model, (x,), schedule="1f1b", n_microbatches=4)

The driver plans the step (the schedule, validated against the split's
dependencies), sends every rank the same small :class:`StepSpec`, and merges
the ranks' results into one :class:`StepResult` keyed by original FQNs. Its
split's tensors go to the ranks in one file in the World's folder, written once
a job and removed after it: each rank builds only its own stages and reads only
their values (pipecheck._split.stage_build).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult
from pipecheck._runners.arguments import check_arguments, plain
from pipecheck._runners.base import run_on_world, stage_state_on
from pipecheck._runners.engine import EngineRunner, merge_reports
from pipecheck._runners.job import Job
from pipecheck._runners.training import train_distributed
from pipecheck._runtime.executor import RankResult, StepSpec, dependencies, rank_step
from pipecheck._runtime.stage_step import InputGradKey, LeafGrads, merge_input_grads
from pipecheck._runtime.timeline import write_chrome_trace
from pipecheck._split.inputs import as_args
from pipecheck._split.microbatch import merge_microbatches, replicated_names
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import Pipe
from pipecheck._world.world import World
from pipecheck.errors import InputError, plural
from pipecheck.schedules import Schedule, make_schedule

ENGINE = "pipecheck's runtime"


def plan_schedule(job: Job, pipe: Pipe) -> Schedule:
    """The job's schedule for ``pipe``, validated against the split's dependencies (skips too)."""
    if isinstance(job.schedule, Schedule):
        schedule = job.schedule
    else:
        if pipe.num_stages == 1 and job.stages_per_rank > 1:
            raise InputError(f"stages_per_rank={job.stages_per_rank} but the model is not cut (1 stage). "
                             "Fix: cut it with pipe_split() markers, split_spec or policy.")
        schedule = make_schedule(str(job.schedule), pipe.num_stages, job.n_microbatches, job.stages_per_rank)
    if schedule.n_stages != pipe.num_stages or schedule.n_microbatches != job.n_microbatches:
        raise InputError(f"schedule {schedule.name!r} is for {plural(schedule.n_stages, 'stage')} and "
                         f"{plural(schedule.n_microbatches, 'micro-batch')}, but the split has "
                         f"{plural(pipe.num_stages, 'stage')} "
                         f"and n_microbatches={job.n_microbatches}. Fix: build the schedule for this split.")
    schedule.validate(dependencies(pipe))
    return schedule


def step_spec(job: Job, schedule: Schedule, pipe: Pipe) -> StepSpec:
    """What every rank gets: the driver's split ``pipe`` as a recipe (no rank traces the model again),
    and the tracer that made it (not "auto" again) for a rank that must."""
    return StepSpec(job.model, job.split_spec, job.policy, pipe.tracer, job.args, job.kwargs, job.loss_fn,
                    job.target, schedule, record=job.boundaries is not None, recipe=pipe.recipe.dumps(),
                    precision=job.precision)


def merge_rank_results(pipe: Pipe, results: Sequence[RankResult], n_microbatches: int,
                       replicated: frozenset[str] = frozenset()) -> StepResult:
    outputs: dict[int, list[Any]] = {}
    losses: dict[int, torch.Tensor] = {}
    input_grads: dict[InputGradKey, LeafGrads] = {}
    for result in results:
        outputs.update(result.outputs)
        losses.update(result.losses)
        input_grads.update(result.input_grads)
    merged = merge_microbatches([pytree.tree_unflatten(outputs[m], pipe.out_spec) for m in range(n_microbatches)])
    step = merge_reports(pipe, results, outputs=merged,
                         loss=torch.stack([losses[m] for m in range(n_microbatches)]).mean(),
                         input_grads=merge_input_grads(input_grads, n_microbatches, replicated))
    step.events = [e for r in results for e in r.events]
    return step


class DistributedRunner(EngineRunner):
    """The "distributed" runner: pipecheck's runtime on the job's World, or a shared one."""

    __name__ = "distributed"
    label = engine = ENGINE
    rank_step = staticmethod(rank_step)
    follows_random_contract = True  # every stage forward draws by pipecheck.randomness (stage_forward)
    follows_precision = True  # forwards under job.precision's autocast, gradients summed in its grad_accumulation

    def plan(self, job: Job, pipe: Pipe) -> StepSpec:
        return step_spec(job, plan_schedule(job, pipe), pipe)

    def n_ranks(self, job: Job, pipe: Pipe, plan: StepSpec) -> int:
        return plan.schedule.n_ranks

    def run(self, world: World, plan: StepSpec, job: Job) -> list[Any]:
        with stage_state_on(world, job, job.structure(), plan.recipe) as state:  # ranks build their own stages
            # pipecheck's own ranks: their errors as the World raises them
            return run_on_world(world, rank_step, dataclasses.replace(plan, state=state), job)

    def train(self, job: Job) -> list[StepResult]:
        """Several optimizer steps, each rank keeping its stages and optimizer (pipecheck._runners.training)."""
        return train_distributed(self, job)

    def merge(self, job: Job, pipe: Pipe, plan: StepSpec, reports: Sequence[RankResult]) -> StepResult:
        replicated = replicated_names(job.bound)
        step = merge_rank_results(pipe, reports, job.n_microbatches, replicated)
        if job.trace_path:
            write_chrome_trace(job.trace_path, step.events, plan.schedule)
        return step


run_distributed = DistributedRunner()


def run_pipeline(world: World, model: Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
                 split_spec: Mapping[str, Any] | None = None, policy: Any = None, tracer: str = "auto",
                 schedule: str | Schedule = "1f1b", n_microbatches: int = 4, loss_fn: Any = None,
                 target: Any = None, stages_per_rank: int = 1, seed: int = 0, timeout: float | None = None,
                 trace_path: str | None = None) -> StepResult:
    """One training step of ``model`` through pipecheck's runtime on ``world``.

        with pc.World(world_size=4) as world:
            res = pc.run_pipeline(world, make_model, (x,), n_microbatches=4, trace_path="t.json")

    ``model`` is an nn.Module or a zero-argument factory; either travels to the ranks pickled.
    """
    check_arguments("run_pipeline", model=model, args=args, kwargs=kwargs, split_spec=split_spec, policy=policy,
                    loss_fn=loss_fn, target=target, n_microbatches=n_microbatches,
                    stages_per_rank=stages_per_rank, seed=seed, timeout=timeout,
                    world=world, world_optional=False, trace_path=trace_path)
    n_microbatches, stages_per_rank, seed, timeout = map(plain, (n_microbatches, stages_per_rank, seed, timeout))
    job = Job(model=ModelFactory(model, seed=seed), args=as_args(args), kwargs=dict(kwargs or {}),
              split_spec=split_spec, policy=policy, tracer=tracer, loss_fn=loss_fn, target=target,
              n_microbatches=n_microbatches, schedule=schedule, world_size=world.world_size,
              stages_per_rank=stages_per_rank, device=world.device, timeout=timeout, world=world,
              trace_path=trace_path)
    return run_distributed(job)
