"""A user's own Megatron model chunks, checked: Megatron's schedules on the chunks its provider builds.

    runner = MegatronChunksRunner(model_provider, num_stages=2)
    pc.assert_equivalent(functools.partial(build_chunk_list, model_provider, 2, 1), (tokens,), runner=runner)
    # what pc.engines.megatron.check_chunks(model_provider, tokens, num_stages=2) does

A Megatron user writes a model provider, ``model_provider(pre_process, post_process)`` (and
``vp_stage`` for the interleaved schedule), that builds one pipeline chunk: a module that takes its
predecessor's output through ``set_input_tensor`` and the micro-batch's inputs as arguments. On the
ranks, each chunk is built by the provider after Megatron's ``parallel_state`` is initialised,
wrapped in Megatron's own ``DistributedDataParallel`` (its gradients land in ``main_grad``), and run
by Megatron's schedule, then ``finalize_model_grads``. The reference is the same provider's chunks
built here, one per stage, run one after another in this process (:class:`MegatronChunkList`),
with the word-embedding weight that Megatron ties between the first and the last chunk
(``share_embeddings_and_output_weights``) one parameter; the ranks load its weights, so both start
from the same values. Parameters are named ``"<stage>.<the chunk's own name>"``.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job
from pipecheck._runners.megatron.chunks_rank import (
    ChunksPlan,
    ChunkStage,
    Provider,
    build_chunk,
    chunk_flags,
    chunks_rank_step,
    run_chunk,
    tensor_state,
)
from pipecheck._runners.megatron.driver import MegatronRunner, pipeline_dtype, unsendable
from pipecheck._runners.megatron.rank import ENGINE
from pipecheck._runtime.boundaries import Boundaries, chain_producers, instrument_module
from pipecheck._split.markers import pipe_split
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.errors import EngineError, InputError
from pipecheck.losses import MicrobatchLoss


class MegatronChunkList(nn.Module):
    """The eager reference of a provider's chunks: child ``"s"`` is stage ``s``'s chunk, each given its
    predecessor's output by ``set_input_tensor`` and the inputs as arguments, a ``pipe_split()``
    between them. Where the first and the last chunk share their word embedding
    (``share_embeddings_and_output_weights``), the last one's weight is the first one's parameter."""

    def __init__(self, provider: Provider, num_stages: int, stages_per_rank: int = 1) -> None:
        super().__init__()
        ranks = num_stages // stages_per_rank
        for stage in range(num_stages):
            self.add_module(str(stage), build_chunk(provider, stage, num_stages, ranks, stages_per_rank))
        self.num_stages = num_stages
        _tie(self.chunk(0), self.chunk(num_stages - 1))

    def chunk(self, stage: int) -> nn.Module:
        return self.get_submodule(str(stage))

    def forward(self, *inputs: Any) -> Any:
        x = None
        for stage in range(self.num_stages):
            if stage:
                pipe_split()
            x = run_chunk(self.chunk(stage), x, inputs)
        return x


def _tie(first: nn.Module, last: nn.Module) -> None:
    """The last chunk's shared output weight replaced by the first chunk's embedding weight, where
    both chunks say they share it (one saying so alone is refused: finalize_model_grads would wait
    for a partner that never comes)."""
    shares = [bool(getattr(chunk, "share_embeddings_and_output_weights", False)) for chunk in (first, last)]
    if shares[0] != shares[1]:
        raise InputError(f"share_embeddings_and_output_weights is {shares[0]} on the first chunk and {shares[1]} on "
                         "the last: finalize_model_grads all-reduces the shared weight between the two, and one "
                         "alone would wait for the other (a hang on NCCL). Fix: set it alike on both.")
    if not shares[0]:
        return
    getter_first = getattr(first, "shared_embedding_or_output_weight", None)
    getter_last = getattr(last, "shared_embedding_or_output_weight", None)
    if not (callable(getter_first) and callable(getter_last)):
        raise InputError("the first and the last chunk set share_embeddings_and_output_weights=True but have no "
                         "shared_embedding_or_output_weight() method, which finalize_model_grads calls to sum the "
                         "tied weight's gradients. Fix: add it (it returns the embedding weight on the first "
                         "chunk and the output weight on the last).")
    weight, replica = getter_first(), getter_last()
    if not isinstance(weight, nn.Parameter) or not isinstance(replica, nn.Parameter) \
            or weight.shape != replica.shape:
        raise InputError(f"shared_embedding_or_output_weight() gives {_described(weight)} on the first chunk and "
                         f"{_described(replica)} on the last: Megatron ties two parameters of one shape. Fix: return "
                         "the word-embedding weight on both.")
    name = next(local for local, param in last.named_parameters() if param is replica)
    owner, _, attr = name.rpartition(".")
    setattr(last.get_submodule(owner), attr, weight)


def _described(value: Any) -> str:
    return f"a parameter of shape {tuple(value.shape)}" if isinstance(value, nn.Parameter) else type(value).__name__


def build_chunk_list(provider: Provider, num_stages: int, stages_per_rank: int) -> MegatronChunkList:
    """The eager reference of a provider's chunks (a top-level function: a picklable model factory)."""
    return MegatronChunkList(provider, num_stages, stages_per_rank)


class MegatronChunksRunner(MegatronRunner):
    """Megatron's schedules on a user's own chunks; the job's model must be its :class:`MegatronChunkList`."""

    def __init__(self, provider: Provider, num_stages: int, stages_per_rank: int = 1, **config: Any) -> None:
        super().__init__(**config)
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
            raise InputError(f"num_stages={num_stages!r} must be an int of at least 2: Megatron's pipeline "
                             "schedules run two or more chunks.")
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1 \
                or num_stages % stages_per_rank or num_stages // stages_per_rank < 2:
            raise InputError(f"stages_per_rank={stages_per_rank!r} must be an int that splits num_stages={num_stages} "
                             "over 2 or more pipeline ranks: Megatron's schedules need a pipeline of at least 2 "
                             "ranks.")
        if not callable(provider):
            raise InputError(f"model_provider={provider!r} must be a function that builds one chunk: "
                             "model_provider(pre_process, post_process) (and vp_stage for the interleaved schedule).")
        self.provider, self.num_stages = provider, num_stages

    rank_step = staticmethod(chunks_rank_step)  # type: ignore[assignment]

    def plan(self, job: Job, pipe: Pipe) -> ChunksPlan:  # type: ignore[override]
        self.refuse_job(job, self.num_stages)
        reference = job.build_model()
        if not isinstance(reference, MegatronChunkList) or reference.num_stages != self.num_stages:
            raise InputError("MegatronChunksRunner checks a provider's chunks against its MegatronChunkList; use "
                             "pc.engines.megatron.check_chunks(model_provider, inputs, num_stages=...).")
        states, fqns = _named_by_stage(reference)  # before the dry run (it may change buffers)
        shape, dtype = _sent_shape(reference, job)
        return ChunksPlan(self.provider, self.num_stages, job.stages_per_rank, states, fqns,
                          job.args, job.loss_fn, job.target, job.n_microbatches, shape, dtype, dict(self.config),
                          record=job.boundaries is not None)

    def n_ranks(self, job: Job, pipe: Pipe, plan: Any) -> int:
        return self.num_stages // job.stages_per_rank

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[Any]) -> StepResult:
        step = super().merge(job, pipe, plan, reports)
        step.notes[-1] += " on the provider's own chunks, wrapped in its DistributedDataParallel"
        return step

    def reference_boundaries(self, job: Job) -> tuple[Boundaries, dict[tuple[int, str], int | None]]:
        """The chunks' boundary values run one after another in this process, micro-batch by
        micro-batch, as the ranks record theirs: each stage receives ``input`` (its predecessor's
        output) and sends ``output``."""
        model = job.build_model()
        assert isinstance(model, MegatronChunkList)
        truth = Boundaries()
        stages = [ChunkStage(model.chunk(s)) for s in range(model.num_stages)]
        for stage, module in enumerate(stages):
            instrument_module(module, stage, ["input"], ["output"], truth)
        n = job.n_microbatches
        loss_of = MicrobatchLoss(job.loss_fn, job.target, n)
        for mb, inputs in enumerate(split_microbatches(job.args, n)):
            x = None
            for module in stages:
                x = module(x, inputs)
            (loss_of(mb, x) / n).backward()
        return truth, chain_producers(truth.values)


def _named_by_stage(reference: MegatronChunkList) -> tuple[tuple[dict[str, torch.Tensor], ...],
                                                           tuple[dict[str, str], ...]]:
    """Each chunk's state dict (its own names) and its names -> the reference's (the tied weight by
    the first chunk's name)."""
    canonical = {id(param): fqn for fqn, param in reference.named_parameters()}
    canonical.update({id(buffer): fqn for fqn, buffer in reference.named_buffers()})
    states, fqns = [], []
    for stage in range(reference.num_stages):
        chunk = reference.chunk(stage)
        states.append(tensor_state(chunk))
        named = [*chunk.named_parameters(remove_duplicate=False), *chunk.named_buffers(remove_duplicate=False)]
        fqns.append({local: canonical.get(id(t), f"{stage}.{local}") for local, t in named})
    return tuple(states), tuple(fqns)


def _sent_shape(reference: MegatronChunkList, job: Job) -> tuple[tuple[int, int, int], str]:
    """The one [seq, micro-batch, hidden] shape every chunk sends, and its dtype, from every
    micro-batch run through a private copy of the chunks here: Megatron's receive buffers have that
    one shape and dtype."""
    chunks = [copy.deepcopy(reference.chunk(s)) for s in range(reference.num_stages - 1)]
    shapes: dict[tuple[int, ...], list[str]] = {}
    dtypes: set[torch.dtype] = set()
    for mb, inputs in enumerate(split_microbatches(job.args, job.n_microbatches)):
        x = None
        for stage, chunk in enumerate(chunks):
            x = run_chunk(chunk, x, inputs)
            problem = unsendable(x)
            if problem is None and (x.dim() != 3 or not x.is_contiguous()):
                problem = (f"a tensor of shape {list(x.shape)}" if x.dim() != 3 else
                           f"a tensor that is not contiguous (shape {list(x.shape)}, strides {list(x.stride())}; "
                           "torch.distributed sends only contiguous tensors, gloo and NCCL alike)")
            if problem is not None:
                raise EngineError(f"{ENGINE} cannot run these chunks: chunk {stage} returns {problem} (micro-batch "
                                  f"{mb}), and Megatron's schedules send one contiguous floating tensor of shape "
                                  "[seq, micro_batch, hidden] that needs a gradient between chunks. Fix: return the "
                                  "hidden states as a contiguous [seq, batch, hidden] tensor, as Megatron's own "
                                  "chunks do.", engine=ENGINE, rank=stage % (reference.num_stages // job.stages_per_rank),
                                  stage=stage)
            shapes.setdefault(tuple(x.shape), []).append(f"chunk {stage}, micro-batch {mb}")
            dtypes.add(x.dtype)
    if len(shapes) > 1:
        seen = "; ".join(f"{list(shape)} ({where[0]}{' ...' if len(where) > 1 else ''})"
                         for shape, where in shapes.items())
        raise EngineError(f"{ENGINE} cannot run these chunks: they send tensors of {len(shapes)} shapes ({seen}), "
                          "and Megatron's receive buffers have one shape, [seq_length, micro_batch_size, "
                          "hidden_size]. Fix: micro-batches of one shape and chunks that send one hidden size.",
                          engine=ENGINE)
    seq, mbs, hidden = next(iter(shapes))
    return (seq, mbs, hidden), pipeline_dtype(dtypes, "these chunks")


def chunk_list_factory(provider: Provider, num_stages: int, stages_per_rank: int) -> Callable[[], MegatronChunkList]:
    """The model factory ``assert_equivalent`` builds the reference with; a provider that cannot be
    called with Megatron's arguments is refused here, naming them."""
    flags = chunk_flags(0, num_stages, num_stages // max(stages_per_rank, 1), stages_per_rank)
    try:
        inspect.signature(provider).bind(**flags)
    except TypeError as err:
        raise InputError(f"the model provider cannot be called as Megatron calls it, with {', '.join(flags)} "
                         f"({err}). Fix: def model_provider(pre_process=True, post_process=True, "
                         "vp_stage=None).") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return functools.partial(build_chunk_list, provider, num_stages, stages_per_rank)


