"""The model under test, built the same way in every process: seeded, copied or made, then cast.

    factory = ModelFactory(make_model, dtype=torch.bfloat16, device="cuda", seed=0)
    model = factory()                     # a fresh, seeded model; the caller's RNG untouched
    on_rank = factory.on("cuda:1")        # the same recipe, built on another device

A factory is what travels to worker processes: a user's nn.Module is deep-copied
(never touched), a zero-argument callable is called under a fixed seed, so every
rank builds bit-identical weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from pipecheck._errors import InputError
from pipecheck._inputs import cast_module

ModelLike = nn.Module | Callable[[], nn.Module]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with every RNG seeded, and leave the caller's RNG states exactly as they were.

    ``torch.manual_seed`` would also queue a lazy reseed of CUDA that ``fork_rng(devices=[])``
    never undoes; CUDA is seeded (and restored) only where it is already initialised.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        yield


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Run a block and put the model's buffers back as they were (a forward may update them)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def build_module(model: ModelLike) -> tuple[nn.Module, bool]:
    """``(module, owned)``: a factory's fresh module (owned) or the caller's own (not owned)."""
    if isinstance(model, nn.Module):
        return model, False
    if callable(model):
        built = model()
        if isinstance(built, nn.Module):
            return built, True
        raise InputError(f"model factory {model!r} returned {type(built).__name__}, not an nn.Module. "
                         "Fix: return the module.")
    raise InputError(f"model must be an nn.Module or a zero-argument factory returning one, got "
                     f"{type(model).__name__}.")


@dataclass(frozen=True)
class ModelFactory:
    """Builds the model under test: seeded, deep-copied or freshly made, cast to dtype/device.

    The global RNG is left as it was (the seed is applied inside ``fork_rng``).
    """

    source: ModelLike
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise InputError(f"dtype={self.dtype!r} is not a floating-point torch.dtype. Fix: pass one, e.g. "
                             "dtype=torch.float32 or torch.bfloat16 (or leave it out to keep the model's own).")
        if self.device is None:
            return
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as err:
            raise InputError(f"device={self.device!r} is not a torch device ({err}). Fix: pass "
                             "'cpu', 'cuda' or 'cuda:N'.") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device={self.device!r}, but CUDA is not available here (torch {torch.__version__}, "
                             f"{torch.cuda.device_count()} GPU(s) visible). Fix: device='cpu', or run on a "
                             "machine with a GPU and a CUDA build of torch.")

    def __call__(self) -> nn.Module:
        with seeded(self.seed):
            model, owned = build_module(self.source)
            if not owned:
                model = copy.deepcopy(model)
        if self.dtype is not None or self.device is not None:
            model = cast_module(model, self.dtype, self.device)
        return model

    def on(self, device: str | torch.device) -> ModelFactory:
        """The same model, built on ``device`` (each rank builds on its own)."""
        return dataclasses.replace(self, device=device)
