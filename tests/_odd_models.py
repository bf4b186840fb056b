"""Picklable factories of odd models, importable by spawned ranks (tests/ is on their sys.path)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn as nn


def numpy_initialised_model() -> nn.Module:
    """Weights drawn from numpy's global RNG, which pipecheck does not seed: other weights each call."""
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 8))
    model.add_module("b", nn.Linear(8, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.from_numpy(np.random.randn(*parameter.shape)))
    return model


def urandom_initialised_model() -> nn.Module:
    """Weights from a generator seeded by os.urandom: no seed reproduces them."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 8))
    model.add_module("b", nn.Linear(8, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


class HangsOnRank1(nn.Module):
    """A model whose second stage never returns on rank 1: a hang in the model, not in the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return self.b(_sleep_on_rank_1(x))


class Reverse(torch.autograd.Function):
    """A gradient reversal: a custom autograd.Function, called in the graph by its class."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class ReversedHangsOnRank1(HangsOnRank1):
    """HangsOnRank1 with a custom autograd.Function in its first stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_sleep_on_rank_1(Reverse.apply(self.a(x))))


class HangsInStage1(nn.Module):
    """A model whose second stage (cut at ``b``) never returns on rank 1: with one stage a rank, rank 0
    waits in a receive for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _sleep_on_rank_1(self.b(self.a(x)))


@torch.fx.wrap
def _sleep_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    import time

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        time.sleep(600)
    return x


class WrongOnRank1(nn.Module):
    """A model whose second stage adds 1 to its output on rank 1 only: the driver's eager and reference
    runs are right, pipecheck's runtime is wrong on stage 1 (a stand-in for an engine bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_one_on_rank_1(self.b(self.a(x)))


class TitanWrongOnRank1(nn.Module):
    """WrongOnRank1 as torchtitan splits models (its forward runs over whichever layers a stage keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return _plus_one_on_rank_1(x)


class PlusOneOnRank1(nn.Module):
    """A DeepSpeed layer that adds 1 on rank 1 only (a stand-in for an engine bug on stage 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_one_on_rank_1(x)


@torch.fx.wrap
def _plus_one_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    return x + 1 if dist.is_initialized() and dist.get_rank() == 1 else x


class NearlyEqualBatchNorm(nn.Module):
    """Linear + BatchNorm1d + ReLU blocks: on inputs whose samples differ by 1e-5 of their size, with
    micro-batches of two, each BatchNorm normalises two nearly equal values and the float32 run is far
    from the float64 truth (a stand-in for torchvision's resnet50 in train mode on 32x32 images)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def nearly_equal_samples(spread: float = 1e-5, batch: int = 8, width: int = 16) -> torch.Tensor:
    return 10 + spread * torch.randn(batch, width, generator=torch.Generator().manual_seed(0))


class ZeroMeanBatchNorm(nn.Module):
    """Conv, BatchNorm, a bias-free 1x1 conv, BatchNorm (MobileNetV3's pattern): the second BatchNorm's
    input has mean 0 per channel, so its running mean is rounding noise (float64: ~1e-18)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 8, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(self.pw(self.bn1(self.conv(x))))
        return self.head(torch.relu(x).mean(dim=(2, 3)))


def zero_mean_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return ZeroMeanBatchNorm()


def images(batch: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def conv_batchnorm_cnn() -> nn.Module:
    """Conv layers with biases, each followed by BatchNorm (which cancels the bias's gradient)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class LayerNormStack(nn.Module):
    """Four Linear-LayerNorm-GELU blocks and an empty buffer (a cache not filled yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU())
                                      for _ in range(4)))
        self.register_buffer("cache", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + self.cache.sum()


class ClippedSqrt(torch.autograd.Function):
    """A square root whose gradient is clipped, as RecurrentGemma's ``SqrtBoundDerivative``: a module-level
    custom Function, kept as one call by both tracers (its backward is not autograd's of its forward)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1.0))  # clipped where x < 1/4: not 1/(2 sqrt x)


class GatedSqrt(nn.Module):
    """A RecurrentGemma-like gate: ``ClippedSqrt`` of a sigmoid, between two layers (cut at ``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * ClippedSqrt.apply(torch.sigmoid(h) * 0.5))
