"""Megatron Core's pipeline schedules on every rank: pipecheck's stages as Megatron model chunks.

    results = world.run(megatron_rank_step, MegatronPlan(...))   # one forward_backward_func step

Each rank cuts the model along the driver's split (its recipe, no trace), wraps its stage(s) as
Megatron model chunks (chunk ``k`` on pipeline rank ``r`` is stage ``k * p + r``), initialises Megatron's ``parallel_state`` on
the World's ranks, runs one step of ``get_forward_backward_func()`` with the job's micro-batches,
then ``finalize_model_grads`` (the tied first/last-stage weight's all-reduce), and reports
gradients and buffers by original FQN. Every boundary travels flattened to ``(numel, 1, 1)``, the
3-d shape Megatron's p2p expects. On a CPU, Megatron's CUDA calls are remapped around the schedule
call only (:func:`cpu_shims`); Megatron's process groups are all destroyed after the step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from pipecheck._core.result import RankReport
from pipecheck._runners.rank_side import buffers_by_fqn, grads_by_fqn, prepare_together
from pipecheck._runtime.boundaries import Boundaries, instrument
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches, unwrap_replicated
from pipecheck._split.pipe import Pipe, Stage, split_on
from pipecheck._world.worker import RankContext
from pipecheck.losses import MicrobatchLoss

ENGINE = "Megatron Core"


@dataclass(frozen=True)
class MegatronPlan:
    """What every rank gets: the split's recipe, the inputs, and the boundaries' flat sizes."""

    model: Any
    split_spec: Any
    policy: Any
    tracer: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Any
    target: Any
    n_microbatches: int
    stages_per_rank: int
    boundary_numel: tuple[int, ...]  # stage s -> s + 1, flattened
    dtype: str  # the boundaries' dtype (Megatron's pipeline_dtype), e.g. "float32"
    tied_fqn: str | None  # the one weight tied between the first and the last stage
    config: dict[str, Any]  # Megatron's TransformerConfig knobs the user set
    record: bool = False  # record boundary values (a failing check's second run, to find where it diverges)
    recipe: bytes | None = None  # the driver's split (pipe.recipe.dumps()): ranks cut along it, no trace

    def split_on(self, device: torch.device) -> Pipe:
        return split_on(device, self.model, self.args, self.kwargs, split_spec=self.split_spec,
                        policy=self.policy, tracer=self.tracer, recipe=self.recipe)


@dataclass
class MegatronRankResult(RankReport):
    outputs: list[Any] = field(default_factory=list)  # last stage: per micro-batch, in order
    losses: list[torch.Tensor] = field(default_factory=list)
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the knobs that change numerics or communication
    config_origins: dict[str, str] = field(default_factory=dict)  # a knob -> where its value came from


# Megatron's TransformerConfig knobs a report names (with their values, Megatron's defaults or the user's).
KNOBS = ("batch_p2p_comm", "batch_p2p_sync", "overlap_p2p_comm", "variable_seq_lengths",
         "deallocate_pipeline_outputs")


def _cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensor factories asked for a CUDA device (``torch.zeros(..., device="cuda")`` in Megatron's
    schedules) make CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shims(device: torch.device) -> Iterator[None]:
    """Megatron Core's schedules on a CPU rank, for the block only: CUDA tensor factories make CPU
    tensors, ``torch.cuda.current_device()`` (its p2p receive buffers) names the CPU and
    ``torch.cuda.synchronize()`` does nothing; all put back after, raise or not. On a CUDA device it
    changes nothing."""
    if device.type == "cuda":
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        with _CudaFactoriesOnCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


class MegatronChunk(nn.Module):
    """One pipecheck stage as a Megatron model chunk: what Megatron's schedules and
    ``finalize_model_grads`` look up on a chunk."""

    def __init__(self, stage: Stage, n_stages: int, config: Any, plan: MegatronPlan) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.stage = stage
        self.module = stage.module  # a GraphModule: its parameters are this chunk's
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = stage.index == 0, stage.index == n_stages - 1
        self.share_embeddings_and_output_weights = plan.tied_fqn is not None and (self.pre_process or
                                                                               self.post_process)
        self.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
        self.input_tensor: torch.Tensor | None = None
        by_fqn = {fqn: local for local, fqn in stage.local_to_fqn.items()}
        self.tied_local = by_fqn.get(plan.tied_fqn) if plan.tied_fqn is not None else None

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        return self.module.get_parameter(self.tied_local) if self.tied_local is not None else None

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Megatron's DDP would reduce across data-parallel replicas here; pipecheck runs one."""

    def scale_gradients(self, scaling: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling)

    def forward(self, inputs: dict[str, Any], received_shape: torch.Size | None) -> tuple[Any, ...]:
        values = []
        for src in self.stage.inputs:
            if src.stage is None:
                values.append(inputs[src.name])
            else:
                assert self.input_tensor is not None and received_shape is not None
                values.append(self.input_tensor.reshape(received_shape))
        return tuple(self.module(*values))


def megatron_rank_step(ctx: RankContext, plan: MegatronPlan) -> MegatronRankResult:
    """What every rank runs (top-level, so it pickles)."""
    result = MegatronRankResult(ctx.rank)
    try:
        prepared = prepare_together(ctx, result, lambda: _prepare(ctx, plan))
        if prepared is not None:
            _step(ctx, plan, prepared, result)
    finally:
        _teardown()  # also after a failure past initialize_model_parallel: the World's next job starts clean
    return result


@dataclass
class _Prepared:
    pipe: Pipe
    chunks: list[MegatronChunk]
    config: Any
    inputs: dict[str, Any]  # the bound, cast inputs (full batch; micro-batches are views of them)
    microbatches: list[dict[str, Any]]
    shapes: dict[int, torch.Size]  # stage -> the shape of the value it receives (from mb 0's dry shapes)
    recorder: Boundaries | None


def _prepare(ctx: RankContext, plan: MegatronPlan) -> _Prepared:
    pp, vp = initialize_megatron(ctx, plan.stages_per_rank)
    ctx.action = "split"
    pipe = plan.split_on(ctx.device)
    mine = my_stages(ctx, plan.stages_per_rank)
    ctx.stage = mine[0]
    config = transformer_config(plan.config, num_layers=pipe.num_stages, hidden_size=1, dtype=plan.dtype, pp=pp,
                                vp=vp)
    chunks = [MegatronChunk(pipe.stages[s], pipe.num_stages, config, plan) for s in mine]
    inputs = cast_inputs(pipe.bind_inputs(plan.args, plan.kwargs), None, ctx.device)
    microbatches = [unwrap_replicated(mb) for mb in split_microbatches(inputs, plan.n_microbatches)]
    shapes = _received_shapes(pipe, microbatches[0], mine)
    recorder = Boundaries() if plan.record else None
    if recorder is not None:  # after the dry forward above: only the schedule's forwards are micro-batches
        instrument(pipe, recorder)
    return _Prepared(pipe, chunks, config, inputs, microbatches, shapes, recorder)


def _received_shapes(pipe: Pipe, first: dict[str, Any], mine: list[int]) -> dict[int, torch.Size]:
    """The shape of the value each of this rank's stages receives, from one forward of micro-batch 0."""
    produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in first.items()}
    shapes: dict[int, torch.Size] = {}
    with torch.no_grad():
        for stage in pipe.stages[:max(mine) + 1]:
            values = [produced[(src.stage, src.name)] for src in stage.inputs]
            received = [v for src, v in zip(stage.inputs, values) if src.stage is not None]
            if stage.index in mine and received:
                shapes[stage.index] = received[0].shape
            if stage.index < max(mine):
                produced.update(zip(((stage.index, name) for name in stage.outputs), stage.module(*values)))
    return shapes


def _step(ctx: RankContext, plan: MegatronPlan, prep: _Prepared, result: MegatronRankResult) -> None:
    n = plan.n_microbatches
    last = LastStage(MicrobatchLoss(plan.loss_fn, cast_inputs(plan.target, None, ctx.device), n))

    def forward_step(data_iterator: Any, chunk: MegatronChunk) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        ctx.stage, ctx.action = chunk.stage.index, f"{chunk.stage.index}F{mb} (Megatron)"
        out = chunk(prep.microbatches[mb], prep.shapes.get(chunk.stage.index))
        if not chunk.post_process:
            # a tensor of its own: gloo sends contiguous tensors only, and deallocate_pipeline_outputs=True
            # frees what was sent (Megatron refuses to free a view)
            return out[0].reshape(-1, 1, 1).clone(), None
        return last(mb, pytree.tree_unflatten(list(out), prep.pipe.out_spec))

    numel = max(plan.boundary_numel, default=1)
    kwargs: dict[str, Any] = {}
    if plan.stages_per_rank == 1 and plan.boundary_numel:
        mine = prep.chunks[0].stage.index
        recv = (plan.boundary_numel[mine - 1], 1, 1) if mine else (numel, 1, 1)
        send = (plan.boundary_numel[mine], 1, 1) if mine < len(plan.boundary_numel) else recv
        kwargs["adjust_tensor_shapes_fn"] = lambda recv_shapes, send_shapes: ([recv], [send])
    run_schedule(ctx, forward_step, list(prep.chunks), n, seq_length=numel, micro_batch_size=1, **kwargs)
    last.report(result, prep.config)
    for chunk in prep.chunks:
        params, buffers = by_name(chunk.stage.local_to_fqn), by_name(chunk.stage.buffer_fqns)
        result.stage_grads[chunk.stage.index], unmapped = grads_by_fqn(chunk.module, params)
        result.unmapped += unmapped
        result.buffers[chunk.stage.index] = buffers_by_fqn(chunk.module, buffers)
    whole = {name: unwrap_replicated(value) for name, value in prep.inputs.items()}  # a Replicated input: its value
    result.input_grads = {name: value.grad.detach().cpu() for name, value in whole.items()
                          if isinstance(value, torch.Tensor) and value.grad is not None}
    if prep.recorder is not None:
        result.boundaries = prep.recorder.exported()


# --- what both Megatron rank steps share (pipecheck's split as chunks, and a user's own chunks) -------

def initialize_megatron(ctx: RankContext, stages_per_rank: int) -> tuple[int, int | None]:
    """Megatron Core imported and its ``parallel_state`` initialised on the World's ranks, one
    pipeline of them: the pipeline size and the virtual one (None without interleaving)."""
    ctx.action = "import megatron.core"
    _import_megatron()
    from megatron.core import parallel_state

    pp, vp = ctx.world_size, (stages_per_rank if stages_per_rank > 1 else None)
    ctx.action = "parallel_state.initialize_model_parallel"
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp,
                                             create_gloo_process_groups=False)
    return pp, vp


def my_stages(ctx: RankContext, stages_per_rank: int) -> list[int]:
    """This rank's stages, as Megatron lays chunks out: chunk ``k`` of pipeline rank ``r`` is stage
    ``k * p + r``."""
    return [k * ctx.world_size + ctx.rank for k in range(stages_per_rank)]


def transformer_config(knobs: dict[str, Any], *, num_layers: int, hidden_size: int, dtype: str, pp: int,
                       vp: int | None, base: Any = None) -> Any:
    """The ``TransformerConfig`` Megatron's schedules read: ``base`` (a chunk's own, its pipeline
    sizes set to this pipeline's) or a new one, with the user's knobs over it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its __post_init__ warns about settings a CPU check does not use
        if base is not None:  # the chunk's own settings, laid out as this pipeline runs
            layout = {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vp}
            if base.pipeline_dtype is None:
                layout["pipeline_dtype"] = getattr(torch, dtype)
            if getattr(base, "microbatch_group_size_per_vp_stage", None) == base.pipeline_model_parallel_size:
                layout["microbatch_group_size_per_vp_stage"] = None  # derived from the pipeline size: again
            return replace(base, **{**layout, **knobs})  # the user's knobs win
        return TransformerConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=1,
                                 pipeline_dtype=getattr(torch, dtype), pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp, **knobs)


class LastStage:
    """The last stage's side of ``forward_step``: each micro-batch's loss and what Megatron's
    ``loss_func`` returns, its output and loss kept for the report."""

    def __init__(self, loss_of: MicrobatchLoss) -> None:
        self.loss_of = loss_of
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def __call__(self, mb: int, model_out: Any) -> tuple[torch.Tensor, Any]:
        loss = self.loss_of(mb, model_out)
        self.outputs[mb] = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                                           model_out)
        self.losses[mb] = loss.detach().cpu().reshape(()).clone()
        # Megatron divides what loss_func returns by the number of micro-batches, in place: a copy
        return loss, lambda value: (value.clone(), {"loss": value.detach().clone()})

    def report(self, result: MegatronRankResult, config: Any, origins: dict[str, str] | None = None) -> None:
        """Outputs and losses in micro-batch order, and the knobs' values (``origins``: where a knob's
        value came from, where not the user or Megatron's defaults)."""
        result.outputs = [self.outputs[mb] for mb in sorted(self.outputs)]
        result.losses = [self.losses[mb] for mb in sorted(self.losses)]
        result.config = {knob: getattr(config, knob) for knob in KNOBS if hasattr(config, knob)}
        result.config_origins = dict(origins or {})


def run_schedule(ctx: RankContext, forward_step: Any, chunks: list[Any], n: int, **shapes: Any) -> None:
    """One step of Megatron's ``get_forward_backward_func()`` over this rank's chunks (a list of them
    for the interleaved schedule), then ``finalize_model_grads``; CPU shims around both."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(range(n)) for _ in chunks]
    ctx.action = "forward_backward_func"
    with cpu_shims(ctx.device):
        get_forward_backward_func()(forward_step_func=forward_step,
                                    data_iterator=iterators if len(chunks) > 1 else iterators[0],
                                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=n,
                                    decoder_seq_length=None, forward_only=False, **shapes)
        ctx.action = "finalize_model_grads"
        finalize_model_grads(chunks)
    ctx.action = "collect grads"


def _import_megatron() -> None:
    """Megatron Core's modules the step uses, imported quietly: at import it warns that Transformer
    Engine and Apex are absent (it falls back to torch), and torch logs that no CUDA runtime is found."""
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension.level
    cpp_extension.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.distributed  # noqa: F401  (its DistributedDataParallel, for a user's chunks)
            import megatron.core.distributed.finalize_model_grads  # noqa: F401
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.pipeline_parallel  # noqa: F401
            import megatron.core.transformer.multi_token_prediction  # noqa: F401  (forward_step imports it)
            import megatron.core.transformer.transformer_config  # noqa: F401
    finally:
        cpp_extension.setLevel(level)


def by_name(fqns: Any) -> Any:
    """A stage module's own names map to the model's FQNs (pipecheck's split keeps the table)."""
    return lambda local, _tensor: fqns.get(local)


def _teardown() -> None:
    """Megatron's process groups, all of them (``destroy_model_parallel`` forgets them but keeps them
    registered with torch.distributed), so the World's next job starts clean."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:  # Megatron never imported (its import failed): nothing to undo
        return
    groups = [group for group in (getattr(parallel_state, "_global_process_group_list", None) or [])
              if group is not None]
    parallel_state.destroy_model_parallel()
    for group in groups:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
