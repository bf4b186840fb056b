"""Models and planted adapter bugs for tests/runners/test_megatron_runner.py, top-level so the ranks
can unpickle them by name."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.nn as nn

from pipecheck import pipe_split

# private: planted bugs are Megatron's rank step with one of its parts changed
from pipecheck._runners.megatron import rank as megatron_rank


class TiedLM(nn.Module):
    """Embedding on the first stage, its weight reused by the output projection on the last: the
    word-embedding tie Megatron sums with finalize_model_grads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.l0 = nn.Linear(8, 8)
        self.l1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l0(self.emb(tokens)))
        pipe_split()
        return self.head(torch.tanh(self.l1(x)))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


class Skip(nn.Module):
    """A value of stage 0 read by stage 2: a skip across a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pipe_split()
        g = self.b(h)
        pipe_split()
        return self.c(g) + h


def rank_step_without_tied_sync(ctx: Any, plan: Any) -> Any:
    """Planted: finalize_model_grads never sums the word embedding's replicas."""
    import importlib

    # the module (megatron.core.distributed's attribute of that name is the function)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    with mock.patch.object(finalize, "_allreduce_word_embedding_grads", lambda *args, **kwargs: None):
        return megatron_rank.megatron_rank_step(ctx, plan)


def rank_step_scaling_loss_twice(ctx: Any, plan: Any) -> Any:
    """Planted: each micro-batch's loss divided by the number of micro-batches before Megatron
    divides it again."""
    real = megatron_rank.MicrobatchLoss

    class Halved(real):  # type: ignore[misc, valid-type]
        def __call__(self, mb: int, output: Any) -> torch.Tensor:
            return super().__call__(mb, output) / plan.n_microbatches

    with mock.patch.object(megatron_rank, "MicrobatchLoss", Halved):
        return megatron_rank.megatron_rank_step(ctx, plan)


def fails_on_ranks() -> nn.Module:
    """Builds eagerly; raises when a rank builds it, after Megatron's parallel state is set up."""
    if torch.distributed.is_initialized():
        raise ValueError("planted failure building the model on a rank")
    return mlp()


class GPTChunk(nn.Module):
    """A pipeline chunk as Megatron users write one: the word and position embeddings on the first
    stage, a pre-norm transformer layer on every stage, the final norm and the output projection
    tied to the word embedding on the last; hidden states travel as [seq, batch, hidden]."""

    def __init__(self, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                 vocab: int = 16, hidden: int = 8, seq: int = 5) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = True
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            self.word_embeddings = nn.Embedding(vocab, hidden)
            self.position_embeddings = nn.Embedding(seq, hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, 2, 16, dropout=0.0, norm_first=True)
        if post_process:
            self.final_norm = nn.LayerNorm(hidden)
            self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        if self.pre_process:
            return self.word_embeddings.weight
        return self.output_layer.weight if self.post_process else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pre_process:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            hidden = (self.word_embeddings(tokens) + self.position_embeddings(positions)).transpose(0, 1).contiguous()
        else:
            assert self.input_tensor is not None
            hidden = self.input_tensor
        hidden = self.layer(hidden)
        if not self.post_process:
            return hidden
        return self.output_layer(self.final_norm(hidden)).transpose(0, 1)  # [batch, seq, vocab]


def gpt_chunk(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> nn.Module:
    return GPTChunk(pre_process, post_process, vp_stage)


def flat_chunk(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """Sends [batch, hidden]: not the [seq, batch, hidden] Megatron's p2p carries."""
    return FlatChunk(pre_process, post_process)


class FlatChunk(GPTChunk):
    def set_input_tensor(self, input_tensor: Any) -> None:
        super().set_input_tensor(input_tensor)
        if self.input_tensor is not None:  # [batch, hidden] back to [seq, batch, hidden]
            self.input_tensor = self.input_tensor.unsqueeze(0).expand(5, -1, -1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out if self.post_process else out.mean(0)


def strided_chunk(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """Sends [seq, batch, hidden] as a transposed view: not contiguous."""
    return StridedChunk(pre_process, post_process)


class StridedChunk(GPTChunk):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out if self.post_process else out.transpose(0, 1).contiguous().transpose(0, 1)


def needs_parallel_state(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """Asks Megatron's parallel_state which pipeline rank builds it (as GPTModel does)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns at import that Transformer Engine is absent
        from megatron.core import parallel_state

    parallel_state.get_pipeline_model_parallel_rank()
    return gpt_chunk(pre_process, post_process)


class ScaledChunk(GPTChunk):
    """Takes two inputs: the tokens and a per-sequence scale every chunk applies."""

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.pre_process:
            return super().forward(tokens) * scale[None, :, None]
        out = super().forward(tokens)
        return out * scale[:, None, None] if self.post_process else out * scale[None, :, None]


def scaled_chunk(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    return ScaledChunk(pre_process, post_process)


def one_sided_tie(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """Only the first chunk says it shares its word embedding."""
    chunk = GPTChunk(pre_process, post_process)
    chunk.share_embeddings_and_output_weights = pre_process
    return chunk


def configured_chunk(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> nn.Module:
    """A chunk carrying its own TransformerConfig, as Megatron's modules do, with batch_p2p_comm=False."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns at import that Transformer Engine is absent
        from megatron.core.transformer.transformer_config import TransformerConfig

        chunk = GPTChunk(pre_process, post_process, vp_stage)
        chunk.config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, batch_p2p_comm=False)
    return chunk


def plain_module(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """No set_input_tensor: not a Megatron chunk."""
    return nn.Linear(4, 4)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def chunks_step_without_finalize(ctx: Any, plan: Any) -> Any:
    """Planted: the adapter never calls finalize_model_grads (the tied embedding's replicas unsummed)."""
    from pipecheck._runners.megatron import chunks_rank

    finalize = __import__("megatron.core.distributed.finalize_model_grads", fromlist=["finalize_model_grads"])
    with mock.patch.object(finalize, "finalize_model_grads", lambda *args, **kwargs: None):
        return chunks_rank.chunks_rank_step(ctx, plan)
