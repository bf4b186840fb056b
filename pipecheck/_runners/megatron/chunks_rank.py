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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from pipecheck._runners.megatron.rank import (
    KNOBS,
    LastStage,
    MegatronRankResult,
    _teardown,
    by_name,
    cpu_shims,
    initialize_megatron,
    my_stages,
    run_schedule,
    transformer_config,
)
from pipecheck._runners.rank_side import buffers_by_fqn, grads_by_fqn, prepare_together
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
    inputs: tuple[Any, ...]  # every chunk's arguments, for the whole batch
    loss_fn: Any
    target: Any
    n_microbatches: int
    shape: tuple[int, int, int]  # [seq, micro-batch, hidden], what every stage sends
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


def run_chunk(chunk: nn.Module, received: Any, inputs: tuple[Any, ...]) -> Any:
    """One chunk as Megatron's schedule runs it: ``set_input_tensor([received])`` (``[None]`` on the
    first stage), then the micro-batch's inputs as its arguments; the received value is let go after."""
    chunk.set_input_tensor([received])  # type: ignore[operator]
    try:
        return chunk(*inputs)
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

    def forward(self, received: Any, inputs: tuple[Any, ...]) -> Any:
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


def _prepare(ctx: RankContext, plan: ChunksPlan) -> tuple[list[int], list[ChunkStage], list[Any], Any, dict[str, str],
                                                         Boundaries | None]:
    pp, vp = initialize_megatron(ctx, plan.stages_per_rank)  # imports Megatron quietly first
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.transformer.transformer_config import TransformerConfig

    mine = my_stages(ctx, plan.stages_per_rank)
    stages, wrapped, configs = [], [], []
    recorder = Boundaries() if plan.record else None
    for s in mine:
        ctx.stage, ctx.action = s, f"the model provider (stage {s})"
        flags = chunk_flags(s, plan.num_stages, pp, plan.stages_per_rank)
        _agree_with_megatron(parallel_state, s, flags)
        chunk = build_chunk(plan.provider, s, plan.num_stages, pp, plan.stages_per_rank)
        ctx.action = f"load the reference's weights (stage {s})"
        _load(chunk, plan.states[s])
        chunk.to(ctx.device)  # a GPU rank's chunk on its GPU (the provider may build it anywhere)
        stage = ChunkStage(chunk)
        if not hasattr(chunk, "model_type"):
            stage.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read off a chunk
        own = getattr(chunk, "config", None)
        configs.append(transformer_config(plan.config, num_layers=plan.num_stages, hidden_size=plan.shape[2],
                                          dtype=plan.dtype, pp=pp, vp=vp,
                                          base=own if isinstance(own, TransformerConfig) else None))
        if recorder is not None:
            instrument_module(stage, s, ["input"], ["output"], recorder)
        ctx.action = f"Megatron's DistributedDataParallel (stage {s})"
        with cpu_shims(ctx.device):
            wrapped.append(DistributedDataParallel(configs[-1], DistributedDataParallelConfig(), stage))
        stages.append(stage)
    own_config = isinstance(getattr(stages[0].module, "config", None), TransformerConfig)
    defaults = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
    origins = {knob: "the chunk's TransformerConfig" for knob in KNOBS
               if own_config and knob not in plan.config and getattr(configs[0], knob, None) != defaults.get(knob)}
    return mine, stages, wrapped, configs[0], origins, recorder


def tensor_state(chunk: nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """A chunk's state dict, its tensors only (a layer's ``_extra_state`` is not one), as CPU copies or
    (``copy=False``) the chunk's own tensors."""
    state = {name: t for name, t in chunk.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    return {name: t.detach().cpu().clone() for name, t in state.items()} if copy else state


def _agree_with_megatron(parallel_state: Any, stage: int, flags: dict[str, Any]) -> None:
    """The chunk's flags as Megatron's own parallel_state says them for this rank's chunk: its first
    and last pipeline stage (virtual stages counted)."""
    vp_stage = flags.get("vp_stage")
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if (first, last) != (flags["pre_process"], flags["post_process"]):
        raise RuntimeError(f"pipecheck's flags for stage {stage} ({flags}) disagree with Megatron's parallel_state "
                           f"(first stage {first}, last stage {last}). This is a pipecheck bug; please report it.")


def _load(chunk: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The reference's weights, so the ranks start where it does (a tied output weight: the
    embedding's value, which the reference's last chunk holds). A chunk the provider builds here
    with other names than in the driver's process is refused."""
    own = tensor_state(chunk, copy=False)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"the model provider built a chunk here whose state differs from the one it built in "
                           f"the driver's process (missing {missing}, unexpected {unexpected}): the provider must "
                           "build the same chunk for the same arguments.")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def _step(ctx: RankContext, plan: ChunksPlan, mine: list[int], stages: list[ChunkStage], wrapped: list[Any],
          config: Any, origins: dict[str, str], recorder: Boundaries | None, result: MegatronRankResult) -> None:
    n = plan.n_microbatches
    microbatches = split_microbatches(cast_inputs(plan.inputs, None, ctx.device), n)
    last = LastStage(MicrobatchLoss(plan.loss_fn, cast_inputs(plan.target, None, ctx.device), n))

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        k = wrapped.index(model)
        ctx.stage, ctx.action = mine[k], f"{mine[k]}F{mb} (Megatron)"
        out = model(stages[k].received, microbatches[mb])
        return (out, None) if mine[k] != plan.num_stages - 1 else last(mb, out)

    seq, mbs, _ = plan.shape
    run_schedule(ctx, forward_step, wrapped, n, seq_length=seq, micro_batch_size=mbs)
    last.report(result, config, origins)
    for stage, s in zip(stages, mine):
        result.stage_grads[s], unmapped = grads_by_fqn(stage.module, by_name(plan.fqns[s]), "main_grad")
        result.unmapped += unmapped
        result.buffers[s] = buffers_by_fqn(stage.module, by_name(plan.fqns[s]))
    if recorder is not None:
        result.boundaries = recorder.exported()
