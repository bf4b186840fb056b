"""Layers and models for the DeepSpeed and torchtitan tests, top-level so spawned ranks can unpickle them.

DeepSpeed layer lists are functions returning ``(layers, inputs, target)``; the LayerSpec classes
are imported inside them, so importing this module never imports DeepSpeed. torchtitan-style
models skip the modules a torchtitan stage does not keep, as torchtitan's own models do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipecheck import pipe_split

# private: planted bugs subclass the DeepSpeed adapter's own recipe
from pipecheck._runners.deepspeed.layers import SplitLayout
from pipecheck._runners.deepspeed.rank import SplitModelSpec

WIDTH, VOCAB, SEQ, BATCH = 8, 16, 3, 8


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# --- DeepSpeed layers ----------------------------------------------------------------------------------


def lm_head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A tied embedding used as the output projection (a TiedLayerSpec's forward_fn)."""
    return F.linear(h, embedding.weight)


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.fc(h)))


class Head(nn.Module):
    """The untied twin of ``lm_head``: its own weight, shaped like the embedding's."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


def plain_layers() -> tuple[list[Any], Any, Any]:
    from deepspeed.pipe import LayerSpec

    layers = [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh), LayerSpec(Block), LayerSpec(nn.Linear, WIDTH, 4)]
    return layers, _randn(BATCH, WIDTH, seed=1), _randn(BATCH, 4, seed=2)


def batchnorm_layers() -> tuple[list[Any], Any, Any]:
    """BatchNorm in train mode: running statistics every micro-batch updates, in order."""
    from deepspeed.pipe import LayerSpec

    layers = [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.BatchNorm1d, WIDTH), LayerSpec(nn.Tanh),
              LayerSpec(nn.Linear, WIDTH, 4)]
    return layers, _randn(BATCH, WIDTH, seed=8), _randn(BATCH, 4, seed=9)


def tied_layers(untied: bool = False) -> tuple[list[Any], Any, Any]:
    """An LM: a tied embedding that is also the output head. ``untied``: the planted bug, the
    TiedLayerSpec pair replaced by two independent layers (same shapes, same names' layers)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    first = LayerSpec(nn.Embedding, VOCAB, WIDTH) if untied else TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH)
    last = LayerSpec(Head) if untied else TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=lm_head)
    layers = [first, LayerSpec(Block), LayerSpec(Block), last]
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return layers, tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def tied_bias_layers(attrs: tuple[str, ...] = ("weight",)) -> tuple[list[Any], Any, Any]:
    """One Linear (weight and bias) used by both stages through a TiedLayerSpec syncing ``attrs``."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    layers = [TiedLayerSpec("shared", nn.Linear, WIDTH, WIDTH, tied_weight_attr=list(attrs)), LayerSpec(nn.Tanh),
              LayerSpec(Block), TiedLayerSpec("shared", nn.Linear, WIDTH, WIDTH, tied_weight_attr=list(attrs))]
    return layers, _randn(BATCH, WIDTH, seed=4), _randn(BATCH, WIDTH, seed=5)


class SplitSkip(nn.Module):
    """x -> (h, h): a hidden value carried along as a tuple element (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h


class SkipInput(nn.Module):
    """x -> (fc(x), x): the model input itself carried to a later stage."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), x


class OnFirst(nn.Module):
    """(h, s) -> (tanh(fc(h)), s)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, s = hs
        return torch.tanh(self.fc(h)), s


class Merge(nn.Module):
    """(h, s) -> fc(h + s)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, s = hs
        return self.fc(h + s)


class DropSecond(nn.Module):
    """(h, s) -> fc(h): the carried value is received but unused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(hs[0])


class WithScale(nn.Module):
    """x -> (fc(x), 0.5): a Python float crossing the boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.fc(x), 0.5


class UseScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, hs: tuple[torch.Tensor, float]) -> torch.Tensor:
        return self.fc(hs[0]) * hs[1]


def chain(*names: str) -> tuple[list[Any], Any, Any]:
    """A layer list of this module's classes by name, on a (BATCH, WIDTH) input, target (BATCH, 4)."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(globals()[name]) for name in names], _randn(BATCH, WIDTH, seed=6), _randn(BATCH, 4, seed=7)


class FailsOnRank(nn.Module):
    """Fine eagerly; raises inside a World's ranks (where torch.distributed is up) on its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if torch.distributed.is_initialized():
            raise ValueError("planted failure inside the engine")
        return self.fc(hs[0] + hs[1])


def rank_resources(ctx: Any) -> dict[str, int]:
    """A World task: this rank's process groups and OS threads (a torn-down engine leaves none)."""
    import os

    return {"groups": len(torch.distributed.distributed_c10d._world.pg_map),
            "threads": len(os.listdir("/proc/self/task"))}


# --- torchtitan-style models -----------------------------------------------------------------------------


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attn(h))
        return h + self.mlp(F.gelu(h))


class Decoder(nn.Module):
    """torchtitan's layout: tok_embeddings, layers (a ModuleDict; a ModuleList with ``as_list``), norm,
    output; forward skips what a stage does not keep."""

    def __init__(self, n_layers: int = 4, as_list: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        blocks = [TitanBlock() for _ in range(n_layers)]
        self.layers: nn.Module = nn.ModuleList(blocks) if as_list else \
            nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = nn.LayerNorm(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers) if isinstance(self.layers, nn.ModuleList) else list(self.layers.values())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.blocks():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def list_decoder() -> Decoder:
    return Decoder(as_list=True)


class SkipDecoder(Decoder):
    """The embedding is added again after the last layer: a value stage 0 makes and the last stage
    needs, which the forward does not pass along."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h = e
        for block in self.blocks():
            h = block(h)
        h = self.norm(h + e) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class GatedDecoder(Decoder):
    """A keyword input with a default (``gate``), read only where ``layers.2`` runs."""

    def forward(self, tokens: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for key, block in self.layers.items():  # type: ignore[operator]
            if key == "2" and gate is not None:
                h = h * torch.sigmoid(gate)
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class RootScaleDecoder(Decoder):
    """A parameter of the root module itself, used on the first and the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) * self.scale if self.tok_embeddings is not None else tokens
        for block in self.blocks():
            h = block(h)
        h = self.norm(h) * self.scale if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def tokens(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator))



# --- a planted bug in the DeepSpeed adapter (tests/mutants/test_engine_mutants.py) ----------------------


class UntiedSplit(SplitModelSpec):
    """runner="deepspeed" whose layer chain forgets the tied modules: each stage keeps its own copy."""

    def layout(self, pipe: Any, bound: Any) -> SplitLayout:
        return dataclasses.replace(super().layout(pipe, bound), tied=())


class SizeAcross(nn.Module):
    """A Python int (a size read on stage 0) used by stage 1: DeepSpeed sends only tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        rows = h.size(0)
        pipe_split()
        return self.b(h).reshape(rows, 2, -1)


class ShapeAcross(nn.Module):
    """A torch.Size (read on stage 0) used by stage 1: neither a tensor nor a number."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        shape = h.size()
        pipe_split()
        return self.b(h).reshape(shape[0], 2, -1)


class UnreducedReplicas(SplitModelSpec):
    """runner="deepspeed" training with DeepSpeed's data-parallel all-reduce switched off
    (``pipeline_enable_backward_allreduce``, the engine's own flag): each replica steps on its shard alone."""

    def engine_built(self, engine: Any) -> None:
        engine.pipeline_enable_backward_allreduce = False
