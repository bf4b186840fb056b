"""The model under test, built the same way in every process: seeded, copied or made, then cast.

    factory = ModelFactory(make_model, dtype=torch.bfloat16, device="cuda", seed=0)
    model = factory()                     # a fresh, seeded model; the caller's RNG untouched
    on_rank = factory.on("cuda:1")        # the same recipe, built on another device

A factory is what travels to worker processes: a user's nn.Module is deep-copied
(never touched), a zero-argument callable is called under a fixed seed, so every
rank builds bit-identical weights. On an accelerator the callable runs under that
device's default-device context: its parameters are made there, not on the host
and copied (a factory that pins its own device still works).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from pipecheck._core.precision import check_dtype
from pipecheck._split.inputs import cast_module
from pipecheck._split.model_outputs import caches_left_out
from pipecheck.errors import InputError

ModelLike = nn.Module | Callable[[], nn.Module]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with every RNG seeded: torch's, Python's ``random`` and numpy's (where numpy is
    imported), and leave the caller's RNG states exactly as they were.

    A factory or forward that draws from numpy or ``random`` then builds and runs the same in every
    process. ``torch.manual_seed`` would also queue a lazy reseed of CUDA that ``fork_rng(devices=[])``
    never undoes; CUDA is seeded (and restored) only where it is already initialised.
    """
    seed = operator.index(seed)  # a numpy integer too: Python's random takes only Python's
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    numpy = sys.modules.get("numpy")
    python_state, numpy_state = random.getstate(), numpy.random.get_state() if numpy else None
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        random.seed(seed)
        if numpy:
            numpy.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy:
                numpy.random.set_state(numpy_state)


def rng_fingerprint() -> tuple[Any, ...]:
    """The states of every RNG :func:`seeded` seeds: equal before and after a block that drew nothing."""
    numpy = sys.modules.get("numpy")
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return (bytes(torch.default_generator.get_state().numpy()),
            tuple(bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()) if cuda else (),
            random.getstate(), numpy.random.get_state()[1].tobytes() if numpy else b"")


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
        try:
            built = model()
        except InputError:  # pipecheck's own factories (a Megatron provider's chunks) say what is wrong already
            raise
        except Exception as err:
            raise InputError(f"the model factory {getattr(model, '__qualname__', model)!r} raised "
                             f"{type(err).__name__}: {err}. Fix: make it build the model when called with no "
                             "arguments (pipecheck calls it under its seed, in every process that runs "
                             "the model).") from err
        if isinstance(built, nn.Module):
            return built, True
        raise InputError(f"model factory {model!r} returned {type(built).__name__}, not an nn.Module. "
                         "Fix: return the module.")
    raise InputError(f"model must be an nn.Module or a zero-argument factory returning one, got "
                     f"{type(model).__name__}.")


def copy_module(model: nn.Module) -> nn.Module:
    """A deep copy of the caller's module (never touched), or an InputError saying how to avoid one."""
    try:
        return copy.deepcopy(model)
    except Exception as err:
        raise InputError(
            f"{type(model).__name__} cannot be copied (copy.deepcopy raised {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); pipecheck checks a copy, never your module. Fix: "
            "pass a zero-argument factory that builds it (model=lambda: MyModel(...)) instead of the module."
        ) from err


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
        check_dtype(self.dtype)
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
        model = self._built_where_it_runs()
        if model is None:
            with seeded(self.seed):
                model, owned = build_module(self.source)
                if not owned:
                    model = copy_module(model)
        if self.dtype is not None or self.device is not None:
            model = cast_module(model, self.dtype, self.device)
        return caches_left_out(model)

    def _built_where_it_runs(self) -> nn.Module | None:
        """A factory's module built on the check's accelerator (its parameters made there, under the
        default-device context: no build on the host and copy), or None to build it on the host: a
        module given (copied as it is), the CPU, or a factory that fails there (one that computes with
        host-only code: numpy, ``.tolist()``), which the host build then runs or explains."""
        device = torch.device(self.device) if self.device is not None else None
        if device is None or device.type == "cpu" or isinstance(self.source, nn.Module) \
                or not callable(self.source):
            return None
        if device.type == "cuda":
            torch.cuda.init()  # before seeding: a lazily initialised CUDA would draw from its default seed
        try:
            with seeded(self.seed), device:
                model = self.source()
        except Exception:
            return None
        return model if isinstance(model, nn.Module) else None

    def on(self, device: str | torch.device) -> ModelFactory:
        """The same model, built on ``device`` (each rank builds on its own)."""
        return dataclasses.replace(self, device=device)


_LAZY = nn.parameter.UninitializedParameter


def refuse_unreproducible(factory: ModelFactory, failed: str) -> None:
    """An InputError if ``factory`` builds different weights on two calls under the same seed.

    Every process that runs the model builds its own copy under :func:`seeded`; a factory that
    draws from ``os.urandom`` or a clock still gives each process other weights, and the pipeline
    then "fails" against an eager model it never held. A module (deep-copied) is always
    reproducible; a factory is built twice only here, after a failure. Only initialised
    parameters are compared: a buffer made with ``torch.empty`` that forward overwrites, or extra
    state, may differ between builds and change nothing.
    """
    if isinstance(factory.source, nn.Module):
        return
    first, second = factory(), factory()
    theirs = dict(second.named_parameters())
    for name, value in first.named_parameters():
        other = theirs.get(name)
        if isinstance(value, _LAZY) or isinstance(other, _LAZY):  # a lazy module, not yet run
            continue
        same = isinstance(other, torch.Tensor) and other.shape == value.shape and other.dtype == value.dtype \
            and bool(torch.equal(other.detach().nan_to_num(), value.detach().nan_to_num()))
        if not same:
            raise InputError(
                f"the model factory {getattr(factory.source, '__qualname__', factory.source)!r} builds "
                f"different weights on each call ({name!r} differs between two calls under seed "
                f"{factory.seed}): the runner's copies (each rank builds its own) are not the eager model "
                f"pipecheck checked against, so the check's verdict ({failed}) says nothing about the pipeline. "
                "pipecheck seeds torch's, numpy's and Python's RNGs; this factory draws from something else "
                "(os.urandom, random.SystemRandom, a clock, a file that changes?). Fix: make it build the same "
                "weights on every call (draw from torch's RNG), or pass the built module instead."
            )


def is_default_generator(generator: torch.Generator) -> bool:
    """Whether ``generator`` is its device's default, passed explicitly (the dispatcher hands over a new
    Python object for it: told apart by its state, which a generator of one's own matches only if seeded
    and drawn alike)."""
    if generator.device.type == "cpu":
        default = torch.default_generator
    elif generator.device.type == "cuda":
        default = torch.cuda.default_generators[generator.device.index or 0]
    else:
        return False
    return generator.initial_seed() == default.initial_seed() and torch.equal(generator.get_state(),
                                                                              default.get_state())
