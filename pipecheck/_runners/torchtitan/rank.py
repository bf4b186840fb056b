"""The rank side of runner="torchtitan": torchtitan's per-stage module split and schedule builder.

    result = titan_rank_step(ctx, spec)     # on every rank of the World, via world.run

Every rank builds the whole model (seeded, so identically), then, before any
communication, runs one micro-batch through every stage as torchtitan will:
``_split_module`` keeps a stage's modules and removes the rest, and the whole
``forward`` runs on what is left (the first stage gets the model's inputs,
each later one the previous stage's output, every stage the keyword inputs).
A forward that cannot run that way, or an intermediate output torch cannot
send, is a :class:`Refusal` every rank agrees on, so no rank waits for a
peer that gave up. Then ``_pipeline_module_split`` builds this rank's stages on
a device mesh over the World's group, ``_build_pipeline_schedule`` the
schedule, and one ``step`` runs.

torchtitan's schedules sum the micro-batches' gradients (``scale_grads=False``);
its trainer divides the loss by the global token count instead. pipecheck's
loss divides each micro-batch's loss by n_microbatches the same way, so the
gradients are those of the mean loss. Parameter names come back as the model
names them: a stage's ``nn.ModuleList`` is renumbered by ``_split_module``
(its ``layers.0`` is the model's ``layers.2``) and is mapped back; a
``ModuleDict`` keeps its keys.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import RankReport
from pipecheck._runners.rank_side import (
    OriginalName,
    buffers_by_fqn,
    grads_by_fqn,
    prepare_together,
)
from pipecheck._runners.torch_pipelining.rank import restructure
from pipecheck._runtime.boundaries import (
    Boundaries,
    instrument_module,
    pause_for_metadata_probes,
)
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.model_factory import ModelFactory
from pipecheck._world.worker import RankContext
from pipecheck.losses import LossFn, MicrobatchLoss

ENGINE = "torchtitan"


@dataclass(frozen=True)
class TitanStepSpec:
    """What every rank receives: the model, its inputs, torchtitan's stage modules and schedule."""

    model: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: LossFn | None
    target: Any
    n_microbatches: int
    schedule: str  # torchtitan's (torch's) schedule name: "1F1B", "GPipe", "Interleaved1F1B", ...
    module_names: tuple[tuple[str, ...], ...]  # module_names_per_stage
    out_spec_json: str  # the model's output structure, as pytree.treespec_dumps text
    scale_loss: bool = True  # divide each micro-batch's loss by n_microbatches (torchtitan sums)
    record: bool = False  # record boundary values (a failing check's second run, to find where it diverges)

    @property
    def out_spec(self) -> pytree.TreeSpec:
        return pytree.treespec_loads(self.out_spec_json)


@dataclass(frozen=True)
class Refusal:
    """Something torchtitan cannot run, found before any communication; every rank finds the same."""

    stage: int
    rank: int  # the rank that would hold the stage
    message: str


@dataclass
class TitanRankResult(RankReport):
    """One rank's share of the step (CPU tensors only), or why it did not run."""

    outputs: Any = None
    losses: list[torch.Tensor] = field(default_factory=list)  # unscaled, per micro-batch (last stage)
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    refusal: Refusal | None = None


def instrument_part(part: nn.Module, stage: int, first_inputs: Sequence[str], recorder: Boundaries) -> None:
    """Record a torchtitan stage module's boundary values: the first stage receives the model's
    positional inputs by their names, every later one ``input`` (what the stage before returned),
    every stage the keyword inputs; each sends ``output`` (``output[i]`` of a tuple)."""
    instrument_module(part, stage, list(first_inputs) if stage == 0 else None, None, recorder)


def positional_names(whole: nn.Module, args: Sequence[Any]) -> list[str]:
    """The names of forward's parameters that ``args`` fill."""
    return list(inspect.signature(whole.forward).parameters)[:len(args)]


# --- the dry run: every stage as torchtitan will run it, in this process -----------------------------


def _sendable(value: Any) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return all(isinstance(v, torch.Tensor) for v in values)


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(type(v).__name__ for v in value)}"
    return f"a {type(value).__name__}"


def dry_run(whole: nn.Module, spec: TitanStepSpec, args: tuple[Any, ...], kwargs: dict[str, Any],
            split_module: Callable[[nn.Module, list[str]], nn.Module], owner: Callable[[int], int]
            ) -> Refusal | None:
    """Micro-batch 0 through every stage as torchtitan runs them (no gradients): the first thing that
    fails, as a Refusal, or None."""
    (mb_args, mb_kwargs), = split_microbatches((args, kwargs), spec.n_microbatches)[:1]
    value: Any = None
    last = len(spec.module_names) - 1
    with torch.no_grad():
        for stage, keep in enumerate(spec.module_names):
            part = split_module(whole, list(keep))
            inputs = mb_args if stage == 0 else tuple(value) if isinstance(value, (tuple, list)) else (value,)
            try:
                value = part(*inputs, **mb_kwargs)
            except Exception as err:
                return Refusal(stage, owner(stage), (
                    f"stage {stage} forward() fails with removed modules ({type(err).__name__}: {err}).\n"
                    f"torchtitan runs the model's whole forward() on every stage, the modules a stage does not "
                    f"keep removed (set to None, or left out of their ModuleList/ModuleDict); stage {stage} keeps "
                    f"{list(keep)}. Fix: make forward() skip what a stage lacks (`if self.norm is not None: "
                    "...`), as torchtitan's models do, or cut where it can."))
            if stage < last and not _sendable(value):
                return Refusal(stage, owner(stage), (
                    f"stage {stage} returns {_describe(value)}: torch's pipeline stages send only a tensor or a "
                    "tuple of tensors to the next stage"))
    return None


# --- the step ---------------------------------------------------------------------------------------


class _TitanLoss:
    """torchtitan's loss_fn: ``(loss, extra)``; the job's loss of micro-batch ``index``, scaled by 1/n.

    The schedule is given micro-batch indices as its target, so each loss knows its micro-batch
    whatever order the schedule computes them in, and uses pipecheck's own target chunk.
    """

    def __init__(self, spec: TitanStepSpec, target: Any) -> None:
        self.loss_of = MicrobatchLoss(spec.loss_fn, target, spec.n_microbatches)
        self.out_spec = spec.out_spec
        self.scale = 1.0 / spec.n_microbatches if spec.scale_loss else 1.0
        self.losses: dict[int, torch.Tensor] = {}

    def __call__(self, output: Any, index: torch.Tensor) -> tuple[torch.Tensor, None]:
        microbatch = int(index.reshape(-1)[0])
        loss = self.loss_of(microbatch, restructure(output, self.out_spec))
        self.losses[microbatch] = loss.detach().cpu()
        return loss * self.scale, None


def original_names(whole: nn.Module, keep: Sequence[str]) -> Callable[[str], str | None]:
    """A stage module's parameter or buffer name -> the whole model's canonical FQN."""
    canonical: dict[str, str] = {}
    for named in (whole.named_parameters(remove_duplicate=False), whole.named_buffers(remove_duplicate=False)):
        first: dict[int, str] = {}
        for name, tensor in named:
            canonical[name] = first.setdefault(id(tensor), name)
    lists = {name: sorted(int(k.split(".", 1)[1]) for k in keep if k.startswith(name + ".")
                          and k.split(".", 1)[1].isdigit())
             for name, child in whole.named_children() if isinstance(child, nn.ModuleList)}

    def original(local: str) -> str | None:
        head, _, rest = local.partition(".")
        if head in lists and rest:
            index, _, tail = rest.partition(".")
            kept = lists[head]
            if not index.isdigit() or int(index) >= len(kept):
                return None
            local = f"{head}.{kept[int(index)]}.{tail}"
        return canonical.get(local)

    return original


@dataclass
class _Prepared:
    stages: list[Any]
    parts: list[nn.Module]
    schedule: Any
    loss: _TitanLoss
    target: torch.Tensor  # micro-batch indices: torch's schedule chunks them into one per micro-batch
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    whole: nn.Module
    named_inputs: dict[str, Any]
    recorder: Boundaries | None = None
    mesh: Any = None  # the pipeline's device mesh (torchtitan's clip_grad_norm_ reduces the norm over it)


def prepare_titan(ctx: RankContext, spec: TitanStepSpec, timings: dict[str, float]) -> _Prepared | Refusal:
    started = time.perf_counter()
    ctx.action = "import torchtitan"
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed.pipeline_parallel import (
        _get_pp_rank_to_stage_indices_mapping,
        _split_module,
    )

    timings["import_s"] = time.perf_counter() - started
    ctx.action = "dry run"
    n_stages = len(spec.module_names)
    get_schedule_class(spec.schedule)  # an unknown name fails here, before any communication

    def owner(stage: int) -> int:
        return next(r for r in range(ctx.world_size) if stage in
                    _get_pp_rank_to_stage_indices_mapping(r, ctx.world_size, spec.schedule, n_stages))

    mine = _get_pp_rank_to_stage_indices_mapping(ctx.rank, ctx.world_size, spec.schedule, n_stages)
    ctx.stage = mine[0]
    factory = spec.model.on(ctx.device) if isinstance(spec.model, ModelFactory) else spec.model
    whole = factory()
    args, kwargs = cast_inputs((tuple(spec.args), dict(spec.kwargs)), None, ctx.device)
    refusal = dry_run(whole, spec, args, kwargs, _split_module, owner)
    if refusal is not None:
        return refusal
    named = dict(inspect.signature(whole.forward).bind(*args, **kwargs).arguments)
    return _Prepared([], [], None, _TitanLoss(spec, cast_inputs(spec.target, None, ctx.device)),
                     torch.arange(spec.n_microbatches, device=ctx.device), args, kwargs, whole, named)


def build_titan(ctx: RankContext, spec: TitanStepSpec, prep: _Prepared) -> None:
    """torchtitan's split and schedule builder (after every rank agreed it can run)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import (
        _build_pipeline_schedule,
        _pipeline_module_split,
    )

    ctx.action = "_pipeline_module_split"
    mesh = prep.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("pp",))
    prep.stages, prep.parts = _pipeline_module_split(prep.whole, mesh, spec.schedule, ctx.device,
                                                     [list(names) for names in spec.module_names])
    if spec.record:
        prep.recorder = Boundaries()
        for stage, part in zip(prep.stages, prep.parts):
            instrument_part(part, stage.stage_index, positional_names(prep.whole, prep.args), prep.recorder)
            pause_for_metadata_probes(stage, prep.recorder)
    batch = next(leaf.shape[0] for leaf in pytree.tree_leaves(prep.args) if isinstance(leaf, torch.Tensor)
                 and leaf.dim() > 0)
    ctx.action = "_build_pipeline_schedule"
    parallelism = ParallelismConfig(pipeline_parallel_degree=ctx.world_size,
                                    pipeline_parallel_schedule=spec.schedule,
                                    pipeline_parallel_microbatch_size=batch // spec.n_microbatches)
    prep.schedule = _build_pipeline_schedule(parallelism=parallelism, local_batch_size=batch, stages=prep.stages,
                                             loss_fn=prep.loss)


def titan_rank_step(ctx: RankContext, spec: TitanStepSpec) -> TitanRankResult:
    """What every rank runs (top-level, so it pickles)."""
    result = TitanRankResult(ctx.rank)
    prepared = ready_titan(ctx, spec, result)
    return result if prepared is None else _step(ctx, spec, prepared, result)


def ready_titan(ctx: RankContext, spec: TitanStepSpec, result: Any) -> _Prepared | None:
    """This rank's torchtitan stages and schedule, built once every rank agreed it can run; None when one
    refused (``result.refusal``, a :class:`Refusal`) or failed before communicating (``result.failure``)."""

    def prepare() -> _Prepared | None:
        prepared = prepare_titan(ctx, spec, result.timings)
        if isinstance(prepared, Refusal):
            result.refusal = prepared
            return None
        return prepared

    prepared = prepare_together(ctx, result, prepare)
    if prepared is not None:
        build_titan(ctx, spec, prepared)
    return prepared


def _step(ctx: RankContext, spec: TitanStepSpec, prep: _Prepared, result: TitanRankResult) -> TitanRankResult:
    first = any(stage.is_first for stage in prep.stages)
    last = any(stage.is_last for stage in prep.stages)
    ctx.stage, ctx.action = prep.stages[0].stage_index, "schedule.step"
    extra: dict[str, Any] = {"target": prep.target, "losses": []} if last else {}
    started = time.perf_counter()
    # The keyword inputs go to every stage (torchtitan's trainer passes them on every rank).
    outputs = prep.schedule.step(*(prep.args if first else ()), **prep.kwargs, **extra)
    result.timings["step_s"] = time.perf_counter() - started
    ctx.action = "collect grads"
    if last:
        result.outputs = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                                         restructure(outputs, spec.out_spec))
        result.losses = [prep.loss.losses[mb] for mb in range(spec.n_microbatches)]
    # torch accumulates into the full-batch inputs through the chunks it made; a keyword input
    # reaches every rank, so each rank holds the gradient of its own stages' uses
    result.input_grads = {name: value.grad.detach().cpu() for name, value in prep.named_inputs.items()
                          if isinstance(value, torch.Tensor) and value.grad is not None}
    for stage, part in zip(prep.stages, prep.parts):
        original = by_local_name(original_names(prep.whole, spec.module_names[stage.stage_index]))
        result.stage_grads[stage.stage_index], unmapped = grads_by_fqn(part, original)
        result.unmapped += unmapped
        result.buffers[stage.stage_index] = buffers_by_fqn(part, original)
    if prep.recorder is not None:
        result.boundaries = prep.recorder.exported()
    return result


def by_local_name(names: Callable[[str], str | None]) -> OriginalName:
    """torchtitan's stage modules are the model's own modules: a name alone finds the FQN."""
    return lambda local, _tensor: names(local)
