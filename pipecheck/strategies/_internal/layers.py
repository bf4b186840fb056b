"""The small modules a generated model is made of, and its one initialiser.

Every layer of a generated model is its own submodule (``l0``, ``l1``, ...), so
even a parameter-free operation such as an add has a module FQN that a
``split_spec`` can name. These definitions use nothing but ``torch``:
:func:`~pipecheck.strategies.to_source` copies their source text verbatim into
the reproduction script, so the script and :func:`~pipecheck.strategies.build`
run the very same code.
"""

from __future__ import annotations

import torch


def uniform_(
    generator: torch.Generator, shape: tuple[int, ...], center: float, bound: float
) -> torch.Tensor:
    """Values uniform in ``[center - bound, center + bound)``, drawn from ``generator`` only."""
    return center + (torch.rand(shape, generator=generator) * 2 - 1) * bound


class Add(torch.nn.Module):
    """``a + b``: a residual connection between two values of the same width."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Multiply(torch.nn.Module):
    """``a * b``, elementwise: a gate between two values of the same width."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


class Concat(torch.nn.Module):
    """``cat([a, b], dim=-1)``: the width is the sum of both widths."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=-1)


class Scale(torch.nn.Module):
    """``h * scale`` with ``scale`` a registered buffer (state that is not a parameter)."""

    scale: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class Shift(torch.nn.Module):
    """``h + shift`` with ``shift`` a registered buffer (state that is not a parameter)."""

    shift: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("shift", torch.empty(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.shift


class TiedLinear(torch.nn.Module):
    """A Linear whose weight IS another layer's ``nn.Parameter`` (the same object).

    ``model.named_parameters()`` lists the shared weight once, under the owner's
    name; ``state_dict()`` lists it under both. With ``transpose`` the weight is
    used as ``weight.t()`` (an embedding reused as an output head).
    """

    def __init__(self, weight: torch.nn.Parameter, transpose: bool, bias: bool) -> None:
        super().__init__()
        self.weight = weight
        self.transpose = transpose
        out_features = weight.shape[1] if transpose else weight.shape[0]
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transpose else self.weight
        return torch.nn.functional.linear(h, weight, self.bias)


class AddInput(torch.nn.Module):
    """``h + extra``, where ``extra`` is a keyword input of the model; ``h`` when it is None.

    The ``is None`` test is decided while tracing: torch.fx sees a Proxy (not
    None) when the keyword is passed, and the constant None when the tracer
    specialises a missing keyword to its default.
    """

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        if extra is None:
            return h
        return h + extra


class GradReverse(torch.autograd.Function):
    """Identity forward, negated gradient: a custom backward autograd would not derive."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor) -> torch.Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class RoundSTE(torch.autograd.Function):
    """Rounding to quarters forward, identity gradient (a straight-through estimator)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor) -> torch.Tensor:
        return torch.round(h * 4) / 4

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ReverseGradient(torch.nn.Module):
    """``GradReverse.apply(h)``: a custom autograd.Function, whose own backward must run."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return GradReverse.apply(h)


class StraightThrough(torch.nn.Module):
    """``RoundSTE.apply(h)``: a custom autograd.Function, whose own backward must run."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return RoundSTE.apply(h)


class RunningMean(torch.nn.Module):
    """``h - mean``, where every forward first moves the buffer ``mean`` towards ``h``'s batch mean:
    state a forward changes, so every micro-batch must see the one the previous one left."""

    mean: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.empty(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.75).add_(0.25 * h.detach().mean(dim=0))
        return h - self.mean


class ScaleByInput(torch.nn.Module):
    """``h * scale``, where ``scale`` is a per-feature model input every micro-batch gets whole."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h * scale


class FunctionalDropout(torch.nn.Module):
    """``F.dropout(h, p, training=self.training)``: dropout written in forward, not as a module."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(h, self.p, training=self.training)


class AttentionDropout(torch.nn.Module):
    """Self-attention over ``h``'s features as tokens (one feature each), its attention weights dropped out
    by ``scaled_dot_product_attention``'s ``dropout_p`` in train mode, as every transformer's attention."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.unsqueeze(-1)  # (batch, width tokens, 1 feature)
        mixed = torch.nn.functional.scaled_dot_product_attention(
            tokens, tokens, tokens, dropout_p=self.p if self.training else 0.0)
        return mixed.squeeze(-1)


class ChannelDropout(torch.nn.Module):
    """``nn.Dropout1d`` on ``h`` seen as ``(batch, channels, width // channels)``: whole channels dropped."""

    def __init__(self, p: float, channels: int) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout1d(p)
        self.channels = channels

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(h.unflatten(-1, (self.channels, -1))).flatten(-2)


class StochasticDepth(torch.nn.Module):
    """``skip + branch * mask``: a residual branch kept per sample with probability ``1 - p`` in train mode
    and scaled by ``1 / (1 - p)`` (stochastic depth, as torchvision's ``stochastic_depth(mode="row")``)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return skip + branch
        keep = 1.0 - self.p
        mask = torch.empty((branch.shape[0], 1), dtype=branch.dtype, device=branch.device).bernoulli_(keep) / keep
        return skip + branch * mask


class CheckpointedDropout(torch.nn.Module):
    """A Linear followed by dropout, under activation checkpointing: backward recomputes the block, and
    its dropout draws the same mask again because the checkpoint restores torch's RNG state."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.linear = torch.nn.utils.skip_init(torch.nn.Linear, width, width)
        self.p = p

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.linear(h), self.p, training=self.training)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False, preserve_rng_state=True)
