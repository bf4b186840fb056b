"""The GPT-like model the check and GPU benchmarks use (issue "GPU-grade speed").

    model = GPT(GPTConfig(d=1024, blocks=8, vocab=8192, seq=256, stages=4))
    ids, target = gpt_inputs(config, batch=32)

Token and position embeddings, ``blocks`` pre-norm transformer blocks with
``nn.MultiheadAttention`` (causal) and a 4x MLP, a final LayerNorm and a head
(tied to the token embedding when ``tied``). ``pipe_split()`` markers cut it
into ``stages`` stages of equal blocks; run eagerly they do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecheck as pc


@dataclass(frozen=True)
class GPTConfig:
    d: int = 256
    blocks: int = 8
    heads: int = 8
    vocab: int = 2048
    seq: int = 64
    stages: int = 4
    tied: bool = False


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d)
        self.attn = nn.MultiheadAttention(config.d, config.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(config.d)
        self.mlp = nn.Sequential(nn.Linear(config.d, 4 * config.d), nn.GELU(), nn.Linear(4 * config.d, config.d))
        self.register_buffer("mask", torch.triu(torch.full((config.seq, config.seq), float("-inf")), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d)
        self.pos = nn.Parameter(torch.randn(config.seq, config.d) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.blocks))
        self.ln_f = nn.LayerNorm(config.d)
        self.head = nn.Linear(config.d, config.vocab, bias=False)
        if config.tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos
        per_stage = self.config.blocks // self.config.stages
        for i, block in enumerate(self.blocks):
            if i and i % per_stage == 0:
                pc.pipe_split()
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_inputs(config: GPTConfig, batch: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    target = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    return ids.to(device), target.to(device)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def split_spec(config: GPTConfig) -> dict[str, str]:
    """The markers' cut as a split_spec by module name (for torch's own pipeline())."""
    per_stage = config.blocks // config.stages
    return {f"blocks.{i}": "BEGINNING" for i in range(per_stage, config.blocks, per_stage)}
