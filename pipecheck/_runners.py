"""What the built-in runners share, and the "reference" runner.

    world = world_for(job, n_ranks=4, engine="pipecheck")   # the job's World, or a shared one
    grads, replicas = merge_stage_grads(stage_grads, pipe.tied_groups)

Built-in runners by name: "reference" (:class:`DetachExecutor` in this
process), "distributed" (pipecheck's runtime on a World), "torch"
(torch.distributed.pipelining on a World).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch

from pipecheck._errors import InputError
from pipecheck._job import Job
from pipecheck._pipe import TiedGroup
from pipecheck._reference import DetachExecutor
from pipecheck._result import StepResult
from pipecheck._world import World

BUILTIN = ("reference", "distributed", "torch")


def run_reference(job: Job) -> StepResult:
    """pipecheck's single-process reference: DetachExecutor on the job's split (the check's own, its
    buffers put back after: a step changes only buffers, never parameters)."""
    with (job.pipe.buffers_restored() if job.pipe is not None else contextlib.nullcontext(job.split())) as pipe:
        return DetachExecutor(pipe).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                         n_microbatches=job.n_microbatches)


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
        raise InputError(
            f"{engine} needs {n_ranks} ranks but {have} {asked}: the split's stages, "
            f"{job.stages_per_rank} per rank, take {n_ranks} ranks. Fix: cut the model into "
            f"{asked * job.stages_per_rank} stages (pipe_split() markers, split_spec or "
            f"policies.balanced_params({asked * job.stages_per_rank})), or use {n_ranks} ranks "
            f"(World({n_ranks}) / world_size={n_ranks})."
        )
    return world if world is not None else World.shared(n_ranks, job.device)


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
