"""The driver side every engine runner shares: plan -> World -> run -> failures -> merge.

    class MyEngineRunner(EngineRunner):
        label, engine, rank_step = "runner='my-engine'", "My Engine", staticmethod(my_rank_step)
        def plan(self, job, pipe): ...                 # what every rank gets; refusals raised here
        def merge(self, job, pipe, plan, reports): ... # a StepResult, most of it from merge_reports

An engine keeps only what is its own: how it plans a step (and what it refuses before any rank
starts), the function its ranks run, and how its outputs and loss come back. Finding the World,
running on it, turning a rank's failure into an EngineError naming the engine, rank and stage, and
merging gradients, replicas and buffers by original FQN are written once, here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from pipecheck._core.result import RankReport, StepResult
from pipecheck._runners.base import (
    engine_error,
    failure_error,
    merge_stage_grads,
    ranks_needed,
    run_engine,
    world_for,
)
from pipecheck._runners.job import Job
from pipecheck._split.pipe import Pipe
from pipecheck._world.worker import RankContext
from pipecheck._world.world import World
from pipecheck.errors import AdapterError, EngineError, WorldError


class EngineRunner:
    """A runner whose engine runs on a World's ranks: ``runner(job) -> StepResult``."""

    label: ClassVar[str]  # how messages name the runner: "runner='torch'"
    engine: ClassVar[str]  # whose engine runs (EngineError.engine): "torch.distributed.pipelining"
    rank_step: Callable[[RankContext, Any], RankReport]  # what every rank runs, given the plan
    running: ClassVar[str] = "in schedule.step"  # what the ranks do when the World reports a failure
    preparing: ClassVar[str] = "before running the schedule"  # what a rank that reports its failure did

    def plan(self, job: Job, pipe: Pipe) -> Any:
        """What every rank gets; raise what the engine cannot run here, before any rank starts."""
        raise NotImplementedError

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[Any]) -> StepResult:
        """One StepResult from the ranks' reports (most of it from :func:`merge_reports`)."""
        raise NotImplementedError

    def n_ranks(self, job: Job, pipe: Pipe, plan: Any) -> int:
        return ranks_needed(pipe.num_stages, job.stages_per_rank)

    def check_world(self, job: Job, world: World) -> None:
        """Raise if the engine cannot run on ``world`` (its devices, its backend)."""

    def setting(self, job: Job, plan: Any) -> str:
        """The engine's settings, as a failure message states them."""
        return (f"schedule {job.schedule!r}, n_microbatches={job.n_microbatches}, "
                f"stages_per_rank={job.stages_per_rank}")

    def world_failed(self, err: WorldError, job: Job, plan: Any) -> EngineError | AdapterError:
        return engine_error(err, self.engine, self.running, self.setting(job, plan))

    def rank_failed(self, report: RankReport, job: Job, plan: Any) -> EngineError | AdapterError:
        assert report.failure is not None
        return failure_error(report.failure, self.engine, self.preparing, self.setting(job, plan))

    def run(self, world: World, plan: Any, job: Job) -> list[Any]:
        return run_engine(world, self.rank_step, plan, job, lambda err: self.world_failed(err, job, plan))

    def __call__(self, job: Job) -> StepResult:
        pipe = job.structure()
        plan = self.plan(job, pipe)
        world = world_for(job, self.n_ranks(job, pipe, plan), self.label)
        self.check_world(job, world)
        started = time.perf_counter()
        reports = self.run(world, plan, job)
        ran = time.perf_counter() - started
        self.raise_reported(job, plan, reports)
        step = self.merge(job, pipe, plan, reports)
        step.timings.setdefault("step_s", ran)  # the ranks' run, not the merge
        return step

    def raise_reported(self, job: Job, plan: Any, reports: Sequence[RankReport]) -> None:
        """A rank's own report of its failure, or parameters it could not name, as an EngineError."""
        failed = next((r for r in reports if r.failure is not None), None)
        if failed is not None:
            raise self.rank_failed(failed, job, plan)
        unmapped = sorted({name for r in reports for name in r.unmapped})
        if unmapped:
            raise EngineError(f"pipecheck could not map {self.engine}'s stage parameters {unmapped} back to the "
                              "model's parameter FQNs, so their gradients cannot be checked. This is a pipecheck "
                              "limitation; please report it with the model.", engine=self.engine)


def merge_reports(pipe: Pipe, reports: Sequence[RankReport], *, outputs: Any, loss: torch.Tensor | None,
                  input_grads: dict[str, torch.Tensor], timing_prefix: str | None = None,
                  placed_buffers: bool = False) -> StepResult:
    """One StepResult from the ranks' reports: each FQN's gradient from the lowest stage holding it,
    every tied replica by stage, every stage's own share, and each buffer from the last stage holding
    it (the one that ran last), or with ``placed_buffers`` from the stage pipecheck places it on.
    Timings are each rank's slowest, named ``{timing_prefix}_{key}``."""
    stage_grads: dict[int, dict[str, torch.Tensor]] = {}
    by_stage: dict[int, dict[str, torch.Tensor]] = {}
    for report in reports:
        stage_grads.update(report.stage_grads)
        by_stage.update(report.buffers)
    grads, replicas = merge_stage_grads(stage_grads, pipe.tied_groups)
    buffers: dict[str, torch.Tensor] = {}
    for s in sorted(by_stage):
        buffers.update({fqn: b for fqn, b in by_stage[s].items() if not placed_buffers or s in pipe.buffer_stages(fqn)})
    keys = dict.fromkeys(key for report in reports for key in report.timings)
    timings = ({f"{timing_prefix}_{key}": max(r.timings.get(key, 0.0) for r in reports) for key in keys}
               if timing_prefix is not None else {})
    return StepResult(outputs=outputs, loss=loss, grads=grads, input_grads=input_grads, buffers=buffers,
                      timings=timings, stage_grads=[stage_grads.get(s, {}) for s in range(pipe.num_stages)],
                      replica_grads=replicas,
                      boundaries={key: value for r in reports for key, value in r.boundaries.items()})
