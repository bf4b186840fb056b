"""A user's Megatron chunks on every rank: built by the provider, wrapped in Megatron's DDP, one step.

    results = world.run(chunks_rank_step, ChunksPlan(...))

Each rank initialises Megatron's ``parallel_state`` on the World's ranks, builds its chunk(s) with
the user's provider (chunk ``k`` on pipeline rank ``r`` is stage ``k * p + r``), loads the
reference's weights into them, wraps each in Megatron's ``DistributedDataParallel`` (gradients in
``main_grad``, as Megatron trains), runs one ``get_forward_backward_func()`` step and
``finalize_model_grads``, and reports gradients, buffers, outputs and losses by the reference's
names. Megatron's CUDA calls are remapped around its calls only (:func:`cpu_shims`); its process
groups are all destroyed after the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._runners.megatron.rank import (
    KNOBS,
    MegatronRankResult,
    _import_megatron,
    _teardown,
    cpu_shims,
)
from pipecheck._runners.rank_side import prepare_together
from pipecheck._runtime.boundaries import Boundaries, instrument_module
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches
from pipecheck._world.worker import RankContext
from pipecheck.errors import InputError
from pipecheck.losses import MicrobatchLoss

Provider = Callable[..., nn.Module]


@dataclass(frozen=True)
class ChunksPlan:
    """What every rank gets: the provider, the reference's weights by stage, the inputs, and the
    shape Megatron's p2p sends between stages."""

    provider: Provider
    num_stages: int
    stages_per_rank: int
    states: tuple[dict[str, torch.Tensor], ...]  # stage -> the chunk's state dict (its own names)
    fqns: tuple[dict[str, str], ...]  # stage -> the chunk's parameter and buffer names -> the reference's
    inputs: Any  # the first chunk's inputs for the whole batch (a tensor or a tuple)
    loss_fn: Any
    target: Any
    n_microbatches: int
    shape: tuple[int, int, int] | None  # [seq, micro-batch, hidden], what every stage sends
    dtype: str  # what every stage sends (Megatron's pipeline_dtype)
    config: dict[str, Any]  # Megatron's TransformerConfig knobs the user set
    record: bool = False  # record boundary values (a failing check's second run)


def chunk_flags(stage: int, num_stages: int, ranks: int, stages_per_rank: int) -> dict[str, Any]:
    """What Megatron's ``get_model`` passes a provider for ``stage``: the first stage pre-processes
    (the embedding), the last post-processes (the head); ``vp_stage``, the chunk's index on its rank,
    only for the interleaved schedule."""
    flags: dict[str, Any] = {"pre_process": stage == 0, "post_process": stage == num_stages - 1}
    if stages_per_rank > 1:
        flags["vp_stage"] = stage // ranks
    return flags


def build_chunk(provider: Provider, stage: int, num_stages: int, ranks: int, stages_per_rank: int) -> nn.Module:
    """One chunk from the user's provider, checked for what Megatron's schedules call on it."""
    flags = chunk_flags(stage, num_stages, ranks, stages_per_rank)
    try:
        chunk = provider(**flags)
    except Exception as err:
        said = ", ".join(f"{key}={value!r}" for key, value in flags.items())
        here = ("" if torch.distributed.is_initialized() else " pipecheck builds every chunk in the checking "
                "process too (the eager reference), where Megatron's process groups do not exist: build the chunk "
                "from these arguments alone.")
        raise InputError(f"the model provider {getattr(provider, '__qualname__', provider)!r} raised "
                         f"{type(err).__name__}: {err} building stage {stage}'s chunk ({said}).{here}") from err
    if not isinstance(chunk, nn.Module) or not callable(getattr(chunk, "set_input_tensor", None)):
        raise InputError(f"the model provider returned {type(chunk).__name__} for stage {stage}, and Megatron's "
                         "schedules need an nn.Module with set_input_tensor(tensor) (the output of the chunk before "
                         "it). Fix: return a model chunk, as Megatron's GPTModel is one.")
    return chunk


def run_chunk(chunk: nn.Module, received: Any, inputs: Any) -> Any:
    """One chunk as Megatron's schedule runs it: ``set_input_tensor([received])`` (``[None]`` on the
    first stage), then the micro-batch's inputs as its arguments; the received value is let go after."""
    chunk.set_input_tensor([received])  # type: ignore[operator]
    try:
        return chunk(*inputs) if isinstance(inputs, tuple) else chunk(inputs)
    finally:
        chunk.set_input_tensor([None])  # type: ignore[operator]


class ChunkStage(nn.Module):
    """A chunk as a stage that can be recorded: what Megatron hands ``set_input_tensor`` is kept and
    passed to ``forward`` as an argument (a recorder sees it and its gradient), then handed on to the
    chunk. Megatron finds the chunk's own attributes (``pre_process``,
    ``shared_embedding_or_output_weight``, ...) through ``module``, as through its DDP wrapper."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.module = chunk
        self.received: Any = None

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.received = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def forward(self, received: Any, inputs: Any) -> Any:
        return run_chunk(self.module, received, inputs)


def chunks_rank_step(ctx: RankContext, plan: ChunksPlan) -> MegatronRankResult:
    """What every rank runs (top-level, so it pickles)."""
    result = MegatronRankResult(ctx.rank)
    try:
        prepared = prepare_together(ctx, result, lambda: _prepare(ctx, plan))
        if prepared is not None:
            _step(ctx, plan, *prepared, result)
    finally:
        _teardown()  # also after a failure past initialize_model_parallel
    return result


def _prepare(ctx: RankContext, plan: ChunksPlan) -> tuple[list[int], list[ChunkStage], list[Any], Any,
                                                         Boundaries | None]:
    ctx.action = "import megatron.core"
    _import_megatron()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = ctx.world_size
    vp = plan.stages_per_rank if plan.stages_per_rank > 1 else None
    ctx.action = "parallel_state.initialize_model_parallel"
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp,
                                             create_gloo_process_groups=False)
    mine = [k * pp + ctx.rank for k in range(plan.stages_per_rank)]
    seq, mbs, hidden = plan.shape or (1, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=plan.num_stages, hidden_size=hidden, num_attention_heads=1,
                                   pipeline_dtype=getattr(torch, plan.dtype), pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vp, **plan.config)
    stages, wrapped = [], []
    recorder = Boundaries() if plan.record else None
    for s in mine:
        ctx.stage, ctx.action = s, f"the model provider (stage {s})"
        chunk = build_chunk(plan.provider, s, plan.num_stages, pp, plan.stages_per_rank)
        ctx.action = f"load the reference's weights (stage {s})"
        _load(chunk, plan.states[s])
        chunk.to(ctx.device)  # a GPU rank's chunk on its GPU (the provider may build it anywhere)
        stage = ChunkStage(chunk)
        if not hasattr(chunk, "model_type"):
            stage.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read off a chunk
        if recorder is not None:
            instrument_module(stage, s, ["input"], ["output"], recorder)
        ctx.action = f"Megatron's DistributedDataParallel (stage {s})"
        with cpu_shims(ctx.device):
            wrapped.append(DistributedDataParallel(config, DistributedDataParallelConfig(), stage))
        stages.append(stage)
    return mine, stages, wrapped, config, recorder


def _load(chunk: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The reference's weights, so the ranks start where it does (a tied output weight: the
    embedding's value, which the reference's last chunk holds). A chunk the provider builds here
    with other names than in the driver's process is refused."""
    own = chunk.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"the model provider built a chunk here whose state differs from the one it built in "
                           f"the driver's process (missing {missing}, unexpected {unexpected}): the provider must "
                           "build the same chunk for the same arguments.")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def _step(ctx: RankContext, plan: ChunksPlan, mine: list[int], stages: list[ChunkStage], wrapped: list[Any],
          config: Any, recorder: Boundaries | None, result: MegatronRankResult) -> None:
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = plan.n_microbatches
    inputs = cast_inputs(plan.inputs, None, ctx.device)
    microbatches = split_microbatches(inputs, n)
    loss_of = MicrobatchLoss(plan.loss_fn, cast_inputs(plan.target, None, ctx.device), n)
    outputs: dict[int, Any] = {}
    losses: dict[int, torch.Tensor] = {}
    last = plan.num_stages - 1

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        k = wrapped.index(model)
        stage, s = stages[k], mine[k]
        ctx.stage, ctx.action = s, f"{s}F{mb} (Megatron)"
        out = model(stage.received, microbatches[mb])
        if s != last:
            return out, None
        loss = loss_of(mb, out)
        outputs[mb] = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, out)
        losses[mb] = loss.detach().cpu().reshape(()).clone()
        # Megatron divides what loss_func returns by the number of micro-batches, in place: a copy
        return loss, lambda value: (value.clone(), {"loss": value.detach().clone()})

    seq, mbs, _hidden = plan.shape or (1, 1, 1)
    iterators = [iter(range(n)) for _ in wrapped]
    ctx.action = "forward_backward_func"
    with cpu_shims(ctx.device):
        get_forward_backward_func()(forward_step_func=forward_step,
                                    data_iterator=iterators if len(wrapped) > 1 else iterators[0],
                                    model=wrapped if len(wrapped) > 1 else wrapped[0], num_microbatches=n,
                                    seq_length=seq, micro_batch_size=mbs, decoder_seq_length=None,
                                    forward_only=False)
        ctx.action = "finalize_model_grads"
        finalize_model_grads(wrapped)
    ctx.action = "collect grads"
    result.config = {knob: getattr(config, knob) for knob in KNOBS if hasattr(config, knob)}
    result.outputs = [outputs[mb] for mb in sorted(outputs)]
    result.losses = [losses[mb] for mb in sorted(losses)]
    for stage, s in zip(stages, mine):
        names = plan.fqns[s]
        grads: dict[str, torch.Tensor] = {}
        for local, param in stage.module.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads[names[local]] = grad.detach().cpu().clone()
        result.stage_grads[s] = grads
        result.buffers[s] = {names[local]: b.detach().cpu().clone() for local, b in stage.module.named_buffers()
                             if local in names}
    if recorder is not None:
        result.boundaries = recorder.exported()
