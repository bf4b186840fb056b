"""The rank side of runner="torch": torch.distributed.pipelining's ``pipeline()`` and one schedule step.

    result = torch_rank_step(ctx, spec)     # on every rank of the World, via world.run

Every rank traces its own fresh copy of the model with torch's ``pipeline()``,
cut where pipecheck cuts (markers translated to torch's, a split_spec or a
policy's cuts as module hooks), builds its stage(s) and runs one ``step`` of
torch's schedule. Each stage's forward and backward name the stage and action
on the rank's context, so a failure report says where it happened. A failure
before any communication is agreed on by all ranks and comes back as data
(:attr:`TorchRankResult.failure`); the World then stays up.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import RankReport
from pipecheck._core.torch_warnings import torch_internal_warnings_ignored
from pipecheck._runners.rank_side import (
    OriginalName,
    buffers_by_fqn,
    grads_by_fqn,
    prepare_together,
)
from pipecheck._runners.torch_pipelining.randomness import ContractPosition, draw_by_contract
from pipecheck._runtime.boundaries import (
    Boundaries,
    instrument_module,
    pause_for_metadata_probes,
)
from pipecheck._schedule.torch_classes import v_warmup_patch
from pipecheck._split.autograd_functions import functions_as_calls, functions_in_export
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.markers import PIPE_SPLIT_OP, SplitPoint
from pipecheck._split.microbatch import split_microbatches, unwrap_replicated
from pipecheck._split.model_factory import ModelFactory
from pipecheck._world.worker import RankContext
from pipecheck.errors import plural
from pipecheck.losses import MicrobatchLoss


class TorchStepError(RuntimeError):
    """Something torch did that pipecheck cannot check (a stray output, a target chunked differently)."""


@dataclass(frozen=True)
class TorchStepSpec:
    """What every rank receives: the model, its inputs, and how torch must cut and schedule it."""

    model: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    target: Any
    n_microbatches: int
    schedule: str  # a key of pipecheck._schedule.torch_classes.TORCH_SCHEDULES: "gpipe", "1f1b", "zbv", ...
    n_stages: int
    module_cuts: dict[str, SplitPoint]  # module FQN -> cut before/after its call
    keep_markers: bool  # False for a policy: pipecheck drops the model's markers then
    out_spec_json: str  # the model's output structure (torch's stages return flat leaves); a TreeSpec
    # itself pickles only with a deprecation warning, so it travels as treespec_dumps text
    torch_class: str  # torch's schedule class, chosen on the driver (pipecheck._schedule.torch_classes.torch_layout)
    stage_to_rank: tuple[int, ...]  # where each stage runs
    record: bool = False  # record boundary values (a failing check's second run, to find where it diverges)
    # torch divides the gradients by n_microbatches after each step (one step: the mean loss). A training
    # loop weighs the losses itself instead: torch's division would also divide what earlier steps accumulated.
    scale_grads: bool = True
    # pipecheck's randomness contract (pipecheck.randomness): every stage forward torch runs is drawn by it
    # under this seed (None: the model draws nothing); pipecheck._runners.torch_pipelining.randomness
    random_seed: int | None = None

    @property
    def out_spec(self) -> pytree.TreeSpec:
        return pytree.treespec_loads(self.out_spec_json)


@dataclass
class TorchRankResult(RankReport):
    """One rank's share of the step (CPU tensors only), or why it could not start."""

    outputs: Any = None  # merged by torch, on the rank holding the last stage
    losses: list[torch.Tensor] = field(default_factory=list)
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # first stage's rank: model inputs


def _translate_markers(keep: bool, traced: list[fx.GraphModule] | None = None
                       ) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """A torch ``split_policy``: pipecheck's marker op -> torch's (or dropped, for a policy); a kept
    autograd.Function as one call (torch's pipeline() refuses export's flat_apply constants)."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        functions_as_calls(gm)
        if traced is not None:
            traced.append(gm)
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is PIPE_SPLIT_OP:
                if keep:
                    with gm.graph.inserting_before(node):
                        gm.graph.call_function(aten_pipe_split_alias, (), {})
                gm.graph.erase_node(node)
        gm.recompile()
        return gm

    return policy


def _hook_cuts(model: nn.Module, cuts: Mapping[str, SplitPoint]) -> None:
    """Cut at module calls with hooks on this rank's own copy of the model."""
    from torch.distributed.pipelining import pipe_split

    for fqn, point in cuts.items():
        module = model.get_submodule(fqn)
        if point is SplitPoint.BEGINNING:
            module.register_forward_pre_hook(lambda _m, _a: pipe_split())
        else:
            module.register_forward_hook(lambda _m, _a, _o: pipe_split())


def _alias_table(model: nn.Module, buffers: bool = False) -> tuple[dict[str, str], dict[int, str]]:
    """Every parameter (or buffer) name, aliases included -> canonical FQN; and id -> canonical FQN."""
    by_id: dict[int, str] = {}
    names: dict[str, str] = {}
    named = model.named_buffers(remove_duplicate=False) if buffers else model.named_parameters(remove_duplicate=False)
    for name, tensor in named:
        names[name] = by_id.setdefault(id(tensor), name)
    return names, by_id


_CALL_SUFFIX = re.compile(r"@\d+")  # torch's name for a module's second call: "shared@1"


def stage_grads(stage_module: nn.Module, names: Mapping[str, str], by_id: Mapping[int, str]
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A torch stage's parameter gradients by original FQN; also the names that map to none."""
    return grads_by_fqn(stage_module, original_fqn(names, by_id))


def original_fqn(names: Mapping[str, str], by_id: Mapping[int, str]) -> OriginalName:
    """How a torch stage's parameter or buffer name maps to the model's FQN: by its name without the
    call suffix torch adds, else by the tensor's identity (an alias torch names its own way)."""
    return lambda local, tensor: names.get(_CALL_SUFFIX.sub("", local)) or by_id.get(id(tensor))


def _non_last_outputs(split_gm: fx.GraphModule, n_stages: int) -> list[tuple[int, int]]:
    """(output leaf, stage) for model outputs torch's pipeline would take from a non-last stage."""
    output = next(n for n in split_gm.graph.nodes if n.op == "output")
    found = []
    for i, leaf in enumerate(pytree.tree_leaves(output.args[0])):
        node = leaf
        while isinstance(node, fx.Node) and node.op == "call_function":  # getitem of a stage's tuple
            node = node.args[0]
        if isinstance(node, fx.Node) and node.op == "call_module":
            stage = int(str(node.target).rsplit("_", 1)[-1])
            if stage != n_stages - 1:
                found.append((i, stage))
    return found


def restructure(output: Any, out_spec: pytree.TreeSpec) -> Any:
    """torch's flat stage output (a tensor or a tuple of leaves) in the model's output structure."""
    leaves = pytree.tree_leaves(output)
    if len(leaves) != out_spec.num_leaves:
        raise TorchStepError(f"torch's last stage returned {len(leaves)} output leaves where the model "
                             f"returns {out_spec.num_leaves}")
    return pytree.tree_unflatten(leaves, out_spec)


class _LossOfMicrobatch:
    """The job's loss on torch's chunks, checking torch chunked the target as pipecheck does."""

    def __init__(self, spec: TorchStepSpec, target: Any, by_index: bool) -> None:
        self.loss_of = MicrobatchLoss(spec.loss_fn, target, spec.n_microbatches)
        self.out_spec = spec.out_spec
        self.by_index = by_index
        self.calls = 0
        self.scale = 1.0  # a training loop's weight of each micro-batch's loss (torch then scales nothing)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        mb = int(target.reshape(-1)[0]) if self.by_index else self.calls
        self.calls += 1
        output = restructure(output, self.out_spec)
        expected = self.loss_of.target(mb, output)
        if not self.loss_of.default and not self.by_index and not torch.equal(target, expected):
            raise TorchStepError(f"torch chunked the target differently from pipecheck at micro-batch {mb} "
                                 f"(torch: shape {tuple(target.shape)}, pipecheck: shape {tuple(expected.shape)})")
        loss = self.loss_of(mb, output)
        return loss if self.scale == 1.0 else loss * self.scale


def _torch_target(target: Any, n: int, device: torch.device) -> tuple[Any, bool]:
    """(what to give torch's step as target, whether it is micro-batch indices)."""
    if isinstance(target, torch.Tensor) and target.dim() > 0 and target.shape[0] % n == 0:
        return target, False
    return torch.arange(n, device=device), True


def _chunk_specs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch's chunk specs for pipecheck's micro-batching: dim 0 for batched tensors, whole for the rest
    (a ``pc.Replicated`` input, a 0-dim tensor, a non-tensor)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    def spec(leaf: Any) -> Any:
        batched = isinstance(leaf, torch.Tensor) and leaf.dim() > 0
        return TensorChunkSpec(0) if batched else _Replicate()

    return pytree.tree_map(spec, args), pytree.tree_map(spec, kwargs)


def _schedule(spec: TorchStepSpec, stages: list[Any], loss: Callable[..., torch.Tensor],
              chunk_specs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, spec.torch_class)
    options: dict[str, Any] = {"n_microbatches": spec.n_microbatches, "loss_fn": loss, "scale_grads": spec.scale_grads,
                               "args_chunk_spec": chunk_specs[0], "kwargs_chunk_spec": chunk_specs[1]}
    return cls(stages[0], **options) if issubclass(cls, schedules.PipelineScheduleSingle) else cls(stages, **options)


def _report_actions(ctx: RankContext, stage: Any) -> None:
    """Name the stage and action on ``ctx`` whenever torch runs one of this stage's chunks."""
    index = stage.stage_index
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        run = getattr(stage, method)

        def reported(mb: int, *args: Any, _run: Any = run, _kind: str = kind, **kwargs: Any) -> Any:
            split = _kind == "B" and kwargs.get("full_backward") is False  # a zero-bubble schedule's I
            ctx.stage, ctx.action = index, f"{index}{'I' if split else _kind}{mb} (torch)"
            return _run(mb, *args, **kwargs)

        setattr(stage, method, reported)  # on torch's stage object of this step, never the user's model


@dataclass
class _Prepared:
    """One rank's torch objects, built before any communication."""

    stages: list[Any]
    schedule: Any
    out_spec: pytree.TreeSpec
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    names: dict[str, str]
    by_id: dict[int, str]
    buffer_names: tuple[dict[str, str], dict[int, str]]
    n_stages: int
    named_inputs: dict[str, Any]  # the model's inputs by parameter name, as given to torch's step
    recorder: Boundaries | None = None
    loss: _LossOfMicrobatch | None = None
    drawing_at: list[ContractPosition] = field(default_factory=list)  # each stage's (a model with random ops)


AliasTable = tuple[dict[str, str], dict[int, str]]


def torch_pipe(spec: TorchStepSpec, device: torch.device) -> tuple[nn.Module, Any, AliasTable, AliasTable]:
    """The model and torch's Pipe of it, built on ``device`` and cut by torch's ``pipeline()`` as the ranks cut
    it (the same trace on every rank, and in the driver when it locates a failure), with the model's
    parameter and buffer alias tables taken before torch traced it."""
    from torch.distributed.pipelining import pipeline

    factory = spec.model.on(device) if isinstance(spec.model, ModelFactory) else spec.model
    model = factory()
    params, buffers = _alias_table(model), _alias_table(model, buffers=True)
    _hook_cuts(model, spec.module_cuts)
    args, kwargs = cast_inputs((tuple(spec.args), dict(spec.kwargs)), None, device)
    mb_args, mb_kwargs = split_microbatches((args, kwargs), spec.n_microbatches)[0]
    traced: list[fx.GraphModule] = []
    with torch_internal_warnings_ignored():  # pipeline() exports and deep-copies TreeSpecs
        with functions_in_export() as functions:  # pipeline() exports: keep custom Functions' backward
            pipe = pipeline(model, tuple(mb_args), dict(mb_kwargs),
                            split_policy=_translate_markers(spec.keep_markers, traced))
    functions.refuse_lost(model, traced[0].graph)
    return model, pipe, params, buffers


def stage_submodule(pipe: Any, stage: int) -> fx.GraphModule:
    """Stage ``stage``'s module in torch's split (``submod_pp_<i>`` from torch 2.13 on, ``submod_<i>`` before)."""
    gm = pipe.split_gm
    return getattr(gm, f"submod_pp_{stage}") if hasattr(gm, f"submod_pp_{stage}") else getattr(gm, f"submod_{stage}")


def instrument_torch_stage(submod: fx.GraphModule, stage: int, recorder: Boundaries) -> list[Any]:
    """Record a torch stage module's boundary values, named as torch's split names them (its
    placeholders; the nodes its output returns)."""
    in_names = [node.name for node in submod.graph.nodes if node.op == "placeholder"]
    output = next(node for node in submod.graph.nodes if node.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    out_names = [node.name if isinstance(node, fx.Node) else f"out{i}" for i, node in enumerate(returned)]
    return instrument_module(submod, stage, in_names, out_names, recorder)


def _prepare(ctx: RankContext, spec: TorchStepSpec) -> _Prepared:
    """Trace with torch's ``pipeline()``, build this rank's stages and the schedule (no communication)."""
    ctx.action = "pipeline() trace"
    model, pipe, (names, by_id), buffer_names = torch_pipe(spec, ctx.device)
    args, kwargs = cast_inputs((tuple(spec.args), dict(spec.kwargs)), None, ctx.device)
    chunk_specs = _chunk_specs(args, kwargs)  # Replicated inputs are whole in every chunk
    args, kwargs = unwrap_replicated((args, kwargs))
    if pipe.num_stages != spec.n_stages:
        raise TorchStepError(f"torch's pipeline() cut the model into {plural(pipe.num_stages, 'stage')} where "
                             f"pipecheck cut {spec.n_stages}")
    mine = [s for s, rank in enumerate(spec.stage_to_rank) if rank == ctx.rank]
    ctx.stage = mine[0]
    stray = _non_last_outputs(pipe.split_gm, pipe.num_stages)
    if stray:
        paths = _leaf_paths(spec.out_spec)
        where = ", ".join(f"{paths[i] if i < len(paths) else f'leaf {i}'} is stage {s}'s" for i, s in stray)
        raise TorchStepError(f"torch returns only last-stage outputs; {where}\n"
                             "(the split graph's output node reads a value of an earlier stage)")
    ctx.action = "build_stage"
    drawing_at: list[ContractPosition] = []
    stages = [pipe.build_stage(s, ctx.device, ctx.group) for s in mine]
    for stage in stages:
        _report_actions(ctx, stage)
        if spec.random_seed is not None:  # torch's forward of each chunk drawn by pipecheck's randomness contract
            drawing_at.append(draw_by_contract(stage, spec.random_seed))
        if any(spec.stage_to_rank[s] == ctx.rank for s in (stage.stage_index - 1, stage.stage_index + 1)
               if 0 <= s < pipe.num_stages):
            v_warmup_patch(stage, stage.group_rank)  # a neighbour stage on this rank: the turn of a V
    target = cast_inputs(spec.target, None, ctx.device)
    torch_target, by_index = _torch_target(target, spec.n_microbatches, ctx.device)
    loss = _LossOfMicrobatch(spec, target, by_index)
    ctx.action = "schedule"
    schedule = _schedule(spec, stages, loss, chunk_specs)
    named_inputs = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    recorder = Boundaries() if spec.record else None
    if recorder is not None:
        for stage in stages:
            instrument_torch_stage(stage.submod, stage.stage_index, recorder)
            pause_for_metadata_probes(stage, recorder)
    return _Prepared(stages, schedule, spec.out_spec, torch_target, tuple(args), dict(kwargs), names, by_id,
                     buffer_names, pipe.num_stages, named_inputs, recorder, loss, drawing_at)


def _leaf_paths(out_spec: pytree.TreeSpec) -> list[str]:
    numbered = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    return ["output" + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(numbered)[0]]


def _step(ctx: RankContext, prep: _Prepared) -> TorchRankResult:
    mine = [stage.stage_index for stage in prep.stages]
    first, last = 0 in mine, prep.n_stages - 1 in mine
    losses: list[torch.Tensor] = []
    step_kwargs: dict[str, Any] = {"target": prep.target, "losses": losses} if last else {}
    ctx.stage, ctx.action = mine[0], "schedule.step"
    with torch_internal_warnings_ignored():  # cuBLAS's context warning from autograd's CUDA thread
        outputs = prep.schedule.step(*(prep.args if first else ()), **(prep.kwargs if first else {}),
                                     **step_kwargs)
    ctx.stage, ctx.action = mine[0], "collect grads"
    result = TorchRankResult(ctx.rank, losses=[loss.detach().cpu().reshape(()) for loss in losses])
    if last:
        outputs = restructure(outputs, prep.out_spec)
        result.outputs = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, outputs)
    if first:  # torch accumulates into the full-batch inputs through the chunks (views) it made
        result.input_grads = {name: value.grad.detach().cpu() for name, value in prep.named_inputs.items()
                              if isinstance(value, torch.Tensor) and value.grad is not None}
    if prep.recorder is not None:
        result.boundaries = prep.recorder.exported()
    for stage in prep.stages:
        result.stage_grads[stage.stage_index], unmapped = stage_grads(stage.submod, prep.names, prep.by_id)
        result.unmapped += unmapped
        result.buffers[stage.stage_index] = buffers_by_fqn(stage.submod, original_fqn(*prep.buffer_names))
    return result


def torch_rank_step(ctx: RankContext, spec: TorchStepSpec) -> TorchRankResult:
    """What every rank runs (top-level, so it pickles). A failure while preparing is returned as data
    once every rank agreed to stop; a failure inside torch's step raises, and the World reports it."""
    stopped = TorchRankResult(ctx.rank)
    prepared = prepare_together(ctx, stopped, lambda: _prepare(ctx, spec))
    return stopped if prepared is None else _step(ctx, prepared)
