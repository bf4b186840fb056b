"""The "megatron" runner: Megatron Core's pipeline schedules on pipecheck's World (CPU and gloo, or
one GPU per rank and NCCL).

    pc.assert_equivalent(model, (x,), runner="megatron", n_microbatches=4)             # 1F1B
    pc.assert_equivalent(model, (x,), runner="megatron", schedule="interleaved", stages_per_rank=2)
    pc.assert_equivalent(model, (x,), runner=MegatronRunner(batch_p2p_comm=False), ...)  # Megatron's knobs

pipecheck's split runs as Megatron model chunks (one per pipeline rank, or ``stages_per_rank`` of
them for the interleaved schedule) through ``forward_backward_pipelining_without_interleaving`` or
``..._with_interleaving``, then ``finalize_model_grads`` (the tied first/last-stage weight summed).
Megatron's ``TransformerConfig`` knobs that change numerics or communication (``batch_p2p_comm``,
``overlap_p2p_comm``, ``deallocate_pipeline_outputs``, ...) are Megatron's own defaults unless given
here, so the check checks what users run (Megatron Core's default ``batch_p2p_comm=True`` with
the interleaved schedule on 2 pipeline ranks gives wrong gradients: a mismatch, not a refusal).

What Megatron cannot run is refused before any rank starts, naming the value and the fix: a stage
that receives more than one value, or a value from a stage other than the one before it (a skip
connection), a value that is not a floating tensor needing a gradient, a shape that changes between
micro-batches, a weight tied between stages other than the first and the last, schedules other than
1F1B and interleaved 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from pipecheck._core.result import StepResult
from pipecheck._runners.engine import EngineRunner, merge_reports
from pipecheck._runners.job import Job
from pipecheck._runners.megatron.rank import (
    ENGINE,
    MegatronPlan,
    MegatronRankResult,
    megatron_rank_step,
)
from pipecheck._schedule.names import schedule_named
from pipecheck._split.microbatch import merge_microbatches, split_microbatches, unwrap_replicated
from pipecheck._split.pipe import Pipe
from pipecheck.errors import EngineError, InputError, plural

DEFAULT_ORIGIN = "Megatron's default"
SCHEDULES = {"1f1b": "forward_backward_pipelining_without_interleaving",
             "interleaved": "forward_backward_pipelining_with_interleaving"}


class MegatronRunner(EngineRunner):
    """runner="megatron"; keyword arguments set Megatron's ``TransformerConfig`` knobs."""

    __name__ = "megatron"
    label, engine = "runner='megatron'", ENGINE
    rank_step = staticmethod(megatron_rank_step)
    running, preparing = "in forward_backward_func", "before forward_backward_func"

    def __init__(self, **config: Any) -> None:
        self.config = dict(config)

    def refuse_job(self, job: Job, num_stages: int) -> None:
        """The job's schedule and stage count, refused where Megatron cannot run them."""
        problems = []
        schedule = _schedule_key(job)
        if schedule not in SCHEDULES:
            problems.append(f"schedule={job.schedule!r}: Megatron Core runs '1f1b' (one stage per rank) and "
                            "'interleaved' (several)")
        elif (schedule == "interleaved") != (job.stages_per_rank > 1):
            problems.append(f"schedule={job.schedule!r} with stages_per_rank={job.stages_per_rank}: Megatron runs "
                            "1F1B with one stage per rank and the interleaved schedule with several")
        if num_stages % job.stages_per_rank:
            problems.append(f"{plural(num_stages, 'stage')} do not split into {job.stages_per_rank} per rank")
        elif num_stages // job.stages_per_rank < 2:
            problems.append(f"{plural(num_stages, 'stage')} at {job.stages_per_rank} per rank make a pipeline of one "
                            "rank, and Megatron's pipeline schedules need 2 or more")
        if problems:
            raise InputError(f"{self.label} cannot run this job: " + "; ".join(problems) + ".")

    def check_world(self, job: Job, world: Any) -> None:
        """Megatron's p2p sends CUDA tensors straight to the process group: NCCL, one GPU per rank."""
        if world.properties.gpus_shared:
            raise EngineError(f"{self.label} cannot run on {world!r}: its {world.world_size} ranks share "
                              f"{len(set(world.properties.devices))} GPU(s) and talk through gloo, and Megatron's "
                              "p2p sends CUDA tensors straight to the process group, which gloo cannot carry. Fix: "
                              "one GPU per rank (NCCL), or device='cpu'.", engine=ENGINE)

    def plan(self, job: Job, pipe: Pipe) -> MegatronPlan:
        self.refuse_job(job, pipe.num_stages)
        structure = _structure_problems(pipe)
        if structure:
            raise EngineError(f"{ENGINE} cannot run this split: " + "; ".join(structure) + ". (refused before any "
                              "rank started)", engine=ENGINE)
        numel, dtype = _boundaries(job)
        if job.stages_per_rank > 1 and len(set(numel)) > 1:
            raise EngineError(f"{ENGINE}'s interleaved schedule sends one shape between every pair of stages, and "
                              f"this split's boundaries hold {sorted(set(numel))} elements. Fix: cut where the "
                              "values passed have one size, or use schedule='1f1b'.", engine=ENGINE)
        tied = pipe.tied_groups[0].fqn if pipe.tied_groups else None
        return MegatronPlan(job.model, job.split_spec, job.policy, pipe.tracer, job.args, dict(job.kwargs),
                            job.loss_fn, job.target, job.n_microbatches, job.stages_per_rank, tuple(numel), dtype,
                            tied, dict(self.config), record=job.boundaries is not None,
                            recipe=pipe.recipe.dumps())

    def setting(self, job: Job, plan: Any) -> str:
        knobs = ", ".join(f"{key}={value!r}" for key, value in sorted(self.config.items())) or "Megatron's defaults"
        return (f"schedule {job.schedule!r}, n_microbatches={job.n_microbatches}, "
                f"stages_per_rank={job.stages_per_rank}, TransformerConfig: {knobs}")

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[MegatronRankResult]) -> StepResult:
        last = next(r for r in reports if r.losses)
        input_grads: dict[str, torch.Tensor] = {}
        for report in reports:  # an input several ranks read: the sum of their shares
            for name, grad in report.input_grads.items():
                input_grads[name] = input_grads[name] + grad if name in input_grads else grad
        step = merge_reports(pipe, reports, outputs=merge_microbatches(last.outputs),
                             loss=torch.stack(last.losses).mean(), input_grads=input_grads)
        origins = reports[0].config_origins  # a knob the user did not set: Megatron's default, or the chunk's own
        knobs = ", ".join(f"{knob}={value!r}" + ("" if knob in self.config else
                                                 f" ({origins.get(knob, DEFAULT_ORIGIN)})")
                          for knob, value in reports[0].config.items())
        step.notes.append(f"{ENGINE} {_version()} ran {SCHEDULES[str(_schedule_key(job))]} with "
                          f"TransformerConfig {knobs}")
        return step


def _structure_problems(pipe: Pipe) -> list[str]:
    """What Megatron's p2p cannot carry: it sends one tensor from each stage to the next, and sums
    one tied weight between the first and the last stage."""
    problems = []
    for stage in pipe.stages[1:]:
        received = [src for src in stage.inputs if src.stage is not None]
        far = [src for src in received if src.stage != stage.index - 1]
        if far:
            problems.append(f"stage {stage.index} reads {', '.join(map(str, far))} (a skip across stages): Megatron "
                            "passes values only from each stage to the next; cut so the value is not carried over "
                            "a stage, or pass it through the stages in between")
        elif len(received) != 1:
            problems.append(f"stage {stage.index} receives {len(received)} values "
                            f"({', '.join(map(str, received)) or 'none'}) from stage {stage.index - 1}: Megatron "
                            "sends exactly one tensor between stages; cut where one value crosses")
    for group in pipe.tied_groups:
        if set(group.stages) != {0, pipe.num_stages - 1} or len(pipe.tied_groups) > 1:
            problems.append(f"{group.fqn} is tied across stages {list(group.stages)}: Megatron sums one weight tied "
                            "between the first and the last stage only (its word embeddings)")
    return problems


def _boundaries(job: Job) -> tuple[list[int], str]:
    """Each boundary's size (stage s to s + 1) and the boundaries' dtype, from every micro-batch run
    through the stages in this process: Megatron's receive buffers have one fixed size and dtype."""
    pipe = dataclasses.replace(job, boundaries=None).split()  # a private copy (the dry run updates its buffers)
    bound = pipe.bind_inputs(job.args, job.kwargs)
    shapes: dict[int, set[tuple[int, ...]]] = {}
    dtypes: set[torch.dtype] = set()
    for mb in split_microbatches(bound, job.n_microbatches):
        produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in unwrap_replicated(mb).items()}
        for stage in pipe.stages[:-1]:
            out = tuple(stage.module(*[produced[(src.stage, src.name)] for src in stage.inputs]))
            produced.update(zip(((stage.index, name) for name in stage.outputs), out))
            sent = out[0] if len(out) == 1 else None
            problem = unsendable(sent) if len(out) == 1 else f"{len(out)} values"
            if problem is not None:
                raise EngineError(f"{ENGINE} cannot run this split: stage {stage.index} sends {problem} "
                                  f"({', '.join(stage.outputs)}), and Megatron passes one floating tensor that needs "
                                  "a gradient between stages. Fix: cut elsewhere.", engine=ENGINE,
                                  rank=stage.index, stage=stage.index)
            assert isinstance(sent, torch.Tensor)
            shapes.setdefault(stage.index, set()).add(tuple(sent.shape))
            dtypes.add(sent.dtype)
    changing = {s: sorted(found) for s, found in shapes.items() if len(found) > 1}
    if changing:
        raise EngineError(f"{ENGINE} cannot run this split: what stage(s) {sorted(changing)} send changes shape "
                          f"between micro-batches ({changing}), and Megatron's receive buffers have one size. Fix: "
                          "micro-batches of one shape.", engine=ENGINE)
    numel = [int(torch.Size(next(iter(shapes[s]))).numel()) for s in sorted(shapes)]
    return numel, pipeline_dtype(dtypes, "this split")


def unsendable(value: Any) -> str | None:
    """What ``value`` is, where Megatron's p2p cannot carry it (it passes one floating tensor that
    needs a gradient); None where it can."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if not value.is_floating_point():
        return f"a {str(value.dtype).removeprefix('torch.')} tensor"
    return None if value.requires_grad else "a tensor that needs no gradient"


def pipeline_dtype(dtypes: set[torch.dtype], what: str) -> str:
    """The one dtype the stages send (Megatron's ``pipeline_dtype``), e.g. "float32"."""
    if len(dtypes) > 1:
        raise EngineError(f"{ENGINE} cannot run {what}: the stages send {sorted(map(str, dtypes))}, and Megatron's "
                          "pipeline has one dtype (pipeline_dtype).", engine=ENGINE)
    return str(next(iter(dtypes))).removeprefix("torch.") if dtypes else "float32"


def _schedule_key(job: Job) -> str | None:
    """The job's schedule as the one table of names keys it ("Interleaved1F1B" -> "interleaved")."""
    entry = schedule_named(job.schedule) if isinstance(job.schedule, str) else None
    return entry.key if entry is not None else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "(version unknown)"


# The "megatron" runner with Megatron Core's own defaults.
run_megatron = MegatronRunner()
