"""The "torchtitan" runner: torchtitan's per-stage module split and schedule, on pipecheck's World.

    pc.assert_equivalent(model, (tokens,), runner="torchtitan", n_microbatches=4)   # names from the cut
    pc.engines.torchtitan.check(model, (tokens,), module_names_per_stage=[["tok_embeddings", ...], ...])

torchtitan splits a model by module names: each stage is a deep copy of the
whole model with the modules it does not keep removed, running the model's
own ``forward``. It understands only top-level children (``"norm"``) and the
entries of a top-level ``ModuleList``/``ModuleDict`` (``"layers.3"``); any
other name is silently ignored, and a container named as a whole is emptied.
``module_names_per_stage`` is derived from pipecheck's cut: every module a
stage calls, as torchtitan names it. A cut inside such a module cannot be
expressed and is refused; so are names torchtitan would silently ignore.

What torchtitan gets wrong without an error shows up as a failing check: a
value a later stage needs that the forward does not pass along, a keyword
input that only some stages read, tied weights (each stage keeps its own copy
and its own share of the gradient), parameters of the root module (copied to
every stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import RankReport, StepResult
from pipecheck._runners.base import (
    ranks_needed,
)
from pipecheck._runners.engine import EngineRunner, merge_reports
from pipecheck._runners.job import Job
from pipecheck._runners.torch_pipelining.rank import restructure
from pipecheck._runners.torchtitan.rank import (
    ENGINE,
    Refusal,
    TitanRankResult,
    TitanStepSpec,
    instrument_part,
    positional_names,
    titan_rank_step,
)
from pipecheck._runtime.boundaries import Boundaries, chain_producers
from pipecheck._schedule.names import SCHEDULES, schedule_named
from pipecheck._split.checkpoints import stage_nodes
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import Replicated, split_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.errors import EngineError, InputError
from pipecheck.losses import MicrobatchLoss


def titan_schedule(schedule: Any, stages_per_rank: int) -> str:
    """torchtitan's name for the job's schedule: pipecheck's names, or one of torch's own."""
    if not isinstance(schedule, str):
        raise InputError(f"runner='torchtitan' takes a schedule name, not {type(schedule).__name__}: torchtitan "
                         "builds its own schedule.")
    entry = schedule_named(schedule)
    if entry is None:
        return schedule  # torchtitan's own name for one of its schedules, or its refusal
    if entry.key == "gpipe" and stages_per_rank > 1:
        return SCHEDULES["looped_bfs"].torchtitan  # torch's GPipe order with several stages per rank
    return entry.torchtitan


def stage_owner(stage: int, n_stages: int, n_ranks: int, schedule: str) -> int:
    """The rank torchtitan places ``stage`` on: round robin, or a "V" for ZBVZeroBubble and DualPipeV."""
    v_shaped = any(entry.placement == "v" and entry.torchtitan == schedule for entry in SCHEDULES.values())
    if v_shaped and stage >= n_ranks:
        return n_stages - 1 - stage
    return stage % n_ranks


def _containers(model: nn.Module) -> set[str]:
    return {name for name, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.ModuleDict))}


def unit_of(model: nn.Module, path: str) -> str | None:
    """The module torchtitan can keep that holds ``path`` (a module, parameter or buffer path): a
    top-level child, or an entry of a top-level ModuleList/ModuleDict. None for the root's own."""
    head, _, rest = path.partition(".")
    if head not in model._modules:
        return None  # the root's own parameter or buffer: torchtitan keeps it on every stage
    if head in _containers(model) and rest:
        return f"{head}.{rest.partition('.')[0]}"
    return head


def module_names_per_stage(model: nn.Module, pipe: Pipe) -> list[list[str]]:
    """torchtitan's ``module_names_per_stage`` for pipecheck's cut of ``model``; EngineError for a cut
    torchtitan cannot make (inside a module it keeps or removes whole)."""
    names: list[list[str]] = []
    inside: dict[str, dict[int, set[str]]] = {}
    for stage in pipe.stages:
        units: list[str] = []
        for node in stage_nodes(stage.module):  # a checkpointed region's calls are the stage's
            if node.op not in ("call_module", "get_attr") or (node.op == "get_attr" and not _is_tensor(stage, node)):
                continue
            path = str(node.target)
            unit = unit_of(model, path)
            if unit is not None:
                inside.setdefault(unit, {}).setdefault(stage.index, set()).add(path)
                if unit not in units:
                    units.append(unit)
        names.append(units)
    split = {unit: by_stage for unit, by_stage in inside.items()
             if len(by_stage) > 1 and len({frozenset(paths) for paths in by_stage.values()}) > 1}
    if split:
        where = "; ".join(f"{unit!r} in stages {', '.join(map(str, sorted(by_stage)))}"
                          for unit, by_stage in split.items())
        first = min(min(by_stage) for by_stage in split.values())
        raise EngineError(
            f"{ENGINE} cannot cut where pipecheck cuts: the cut runs through {where}. torchtitan keeps or removes "
            "whole top-level children and whole entries of a top-level ModuleList/ModuleDict, and ignores "
            "nested names such as 'encoder.layers.1'. Fix: cut between such modules (split_spec or "
            "pipe_split() markers).", engine=ENGINE, stage=first)
    return names


def _is_tensor(stage: Any, node: fx.Node) -> bool:
    try:
        return isinstance(stage.module.get_parameter(str(node.target)), torch.Tensor)
    except AttributeError:
        try:
            return isinstance(stage.module.get_buffer(str(node.target)), torch.Tensor)
        except AttributeError:
            return False


def name_problems(model: nn.Module, names: Sequence[Sequence[str]]) -> list[str]:
    """What torchtitan would silently get wrong with ``names`` (empty: nothing)."""
    problems = []
    containers = _containers(model)
    listed = {name for stage in names for name in stage}
    for name in sorted(listed):
        head, _, rest = name.partition(".")
        child = model._modules.get(head)
        if child is None:
            problems.append(f"{name!r} is not a child of {type(model).__name__} (torchtitan ignores it)")
        elif head in containers and not rest:
            problems.append(f"{name!r} names a whole {type(child).__name__}: torchtitan empties it on every stage; "
                            f"list its entries ({head}.0, {head}.1, ...)")
        elif head in containers and rest not in child._modules:
            problems.append(f"{name!r}: {head} has no entry {rest!r}")
        elif head not in containers and rest:
            problems.append(f"{name!r} is nested inside {head!r}: torchtitan ignores nested names and drops "
                            f"{head!r} from every stage")
    holders = {unit_of(model, fqn) for fqn, _ in model.named_parameters()} - {None}
    dropped = sorted(unit for unit in holders if unit not in listed)  # type: ignore[type-var]
    if dropped:
        problems.append(f"modules holding parameters are on no stage, so torchtitan drops them: {dropped}")
    return problems


class TorchtitanRunner(EngineRunner):
    """runner="torchtitan"; ``module_names_per_stage`` given here must agree with the job's cut.

    ``scale_loss=False`` leaves each micro-batch's loss undivided, as torchtitan's schedules take it
    (gradients n_microbatches times those of the mean loss): what a trainer that forgets to normalise
    computes.
    """

    __name__ = "torchtitan"
    label, engine = "runner='torchtitan'", ENGINE
    rank_step = staticmethod(titan_rank_step)

    def __init__(self, module_names_per_stage: Sequence[Sequence[str]] | None = None, *,
                 scale_loss: bool = True) -> None:
        self.names = None if module_names_per_stage is None else [list(s) for s in module_names_per_stage]
        self.scale_loss = scale_loss

    def plan(self, job: Job, pipe: Pipe) -> TitanStepSpec:
        if str(job.device) != "cpu":
            raise InputError(f"runner='torchtitan' runs on CPU (gloo) here; device={job.device!r} is not checked.")
        replicated = [name for name, value in job.bound.items()
                      if isinstance(value, Replicated)]
        if replicated:
            raise InputError(f"runner='torchtitan' cannot take pc.Replicated inputs ({replicated}): torchtitan's "
                             "schedule splits every tensor input on dim 0.")
        model = job.build_model()
        schedule = titan_schedule(job.schedule, job.stages_per_rank)
        n_ranks = ranks_needed(pipe.num_stages, job.stages_per_rank)
        try:
            derived = module_names_per_stage(model, pipe)
        except EngineError as err:
            if err.stage is not None:
                err.rank = stage_owner(err.stage, pipe.num_stages, n_ranks, schedule)
            raise
        names = self.names if self.names is not None else derived
        problems = name_problems(model, names)
        if self.names is not None and [set(s) for s in self.names] != [set(s) for s in derived]:
            problems.append(f"module_names_per_stage {self.names} does not match the job's cut, which calls "
                            f"{derived} per stage")
        if problems:
            raise EngineError(f"{ENGINE} cannot split {type(model).__name__} this way: " + "; ".join(problems)
                              + ".", engine=ENGINE)
        return TitanStepSpec(job.model, job.args, dict(job.kwargs), job.loss_fn, job.target, job.n_microbatches,
                             schedule, tuple(tuple(s) for s in names),
                             pytree.treespec_dumps(pipe.out_spec), self.scale_loss,
                             record=job.boundaries is not None)

    def reference_boundaries(self, job: Job) -> tuple[Boundaries, dict[tuple[int, str], int | None]]:
        """The boundary values a correct run of torchtitan's own stage modules gives: the modules
        ``_split_module`` makes from the job's model, run one after another in this process, micro-batch
        by micro-batch (each loss divided by n_microbatches, as the reference's); and each stage
        input's producing stage. What the ranks record is lined up with these."""
        from torchtitan.distributed.pipeline_parallel import _split_module

        spec = self.plan(job, job.structure())
        device = torch.device(job.device)
        whole = job.build_model()
        args, kwargs = cast_inputs((tuple(job.args), dict(job.kwargs)), None, device)
        parts = [_split_module(whole, list(keep)) for keep in spec.module_names]
        truth = Boundaries()
        for stage, part in enumerate(parts):
            instrument_part(part, stage, positional_names(whole, args), truth)
        n = job.n_microbatches
        loss_of = MicrobatchLoss(job.loss_fn, cast_inputs(job.target, None, device), n)
        for mb, (mb_args, mb_kwargs) in enumerate(split_microbatches((args, kwargs), n)):
            value: Any = None
            for stage, part in enumerate(parts):
                inputs = mb_args if stage == 0 else tuple(value) if isinstance(value, (tuple, list)) else (value,)
                value = part(*inputs, **mb_kwargs)
            (loss_of(mb, restructure(value, spec.out_spec)) / n).backward()
        return truth, chain_producers(truth.values)

    def train(self, job: Job) -> list[StepResult]:
        """Several optimizer steps on one schedule, torchtitan's clipping (``train.py`` beside this)."""
        from pipecheck._runners.torchtitan.train import train_titan

        return train_titan(self, job)

    def setting(self, job: Job, plan: TitanStepSpec) -> str:
        return (f"schedule {plan.schedule!r}, n_microbatches={job.n_microbatches}, module_names_per_stage="
                f"{[list(s) for s in plan.module_names]}")

    def raise_reported(self, job: Job, plan: TitanStepSpec, reports: Sequence[RankReport]) -> None:
        refusals = [getattr(r, "refusal", None) for r in reports]  # a step's or a training loop's report
        refused = next((refusal for refusal in refusals if isinstance(refusal, Refusal)), None)
        if refused is not None:
            raise EngineError(f"{refused.message}\n{ENGINE} refused before running: stage {refused.stage} (rank "
                              f"{refused.rank}); {self.setting(job, plan)}.", engine=ENGINE, rank=refused.rank,
                              stage=refused.stage)
        super().raise_reported(job, plan, reports)

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[TitanRankResult]) -> StepResult:
        last = next(r for r in reports if r.losses)
        input_grads: dict[str, torch.Tensor] = {}
        for report in reports:  # a keyword input used on several ranks: the sum of their shares
            for name, grad in report.input_grads.items():
                input_grads[name] = input_grads[name] + grad if name in input_grads else grad
        return merge_reports(pipe, reports, outputs=last.outputs, loss=torch.stack(last.losses).mean(),
                             input_grads=input_grads, timing_prefix="torchtitan", placed_buffers=True)


# The "torchtitan" runner, module names derived from the job's cut.
run_torchtitan = TorchtitanRunner()
