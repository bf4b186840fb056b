"""A check's job, as every runner receives it, and the Runner protocol.

    def my_runner(job: pc.Job) -> pc.StepResult:
        model = job.build_model()            # fresh, seeded, in the job's dtype/device
        ...                                  # run it through your pipeline engine
        return pc.StepResult(outputs, loss, grads_by_original_fqn)

    pc.assert_equivalent(model, (x,), runner=my_runner)

A runner is any callable ``runner(job) -> StepResult``. ``job.model`` is a
picklable zero-argument factory, which is what travels to worker processes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._errors import InputError
from pipecheck._pipe import Pipe, split
from pipecheck._result import StepResult
from pipecheck.policies import Policy

LossFn = Callable[[Any, Any], torch.Tensor]


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


@dataclass
class ModelFactory:
    """Builds the model under test: seeded, deep-copied or freshly made, cast to dtype/device.

    The global RNG is left as it was (the seed is applied inside ``fork_rng``).
    """

    source: nn.Module | Callable[[], nn.Module]
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    seed: int = 0

    def __call__(self) -> nn.Module:
        with seeded(self.seed):
            if isinstance(self.source, nn.Module):
                model = copy.deepcopy(self.source)
            else:
                model = self.source()
                if not isinstance(model, nn.Module):
                    raise InputError(f"model factory {self.source!r} returned {type(model).__name__}, "
                                     "not an nn.Module. Fix: return the module.")
        if self.dtype is not None or self.device is not None:
            model = model.to(device=self.device, dtype=self.dtype)
        return model


def cast_inputs(value: Any, dtype: torch.dtype | None, device: str | torch.device | None) -> Any:
    """Copy floating tensors to ``dtype``/``device``, keeping requires_grad; never in place."""

    def cast(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        target_dtype = dtype if dtype is not None and leaf.is_floating_point() else leaf.dtype
        if target_dtype == leaf.dtype and (device is None or torch.device(device) == leaf.device):
            return leaf
        return leaf.detach().to(device=device, dtype=target_dtype).requires_grad_(leaf.requires_grad)

    return pytree.tree_map(cast, value)


@dataclass
class Job:
    """Everything a runner needs for one step of one model."""

    model: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    split_spec: Mapping[str, Any] | None = None
    policy: Policy | None = None
    tracer: str = "fx"
    loss_fn: LossFn | None = None
    target: Any = None
    n_microbatches: int = 1
    schedule: str | Any = "1f1b"  # a name, or a pipecheck.schedules.Schedule
    world_size: int | None = None
    stages_per_rank: int = 1
    device: str = "cpu"
    timeout: float | None = None
    options: dict[str, Any] = field(default_factory=dict)  # runner-specific extras (e.g. trace_path)

    def build_model(self) -> nn.Module:
        return self.model()

    def split(self) -> Pipe:
        """The job's model cut as the job asks, ready for a pipeline engine."""
        return split(self.build_model(), self.args, self.kwargs, split_spec=self.split_spec,
                     policy=self.policy, tracer=self.tracer)


@runtime_checkable
class Runner(Protocol):
    """Any callable that runs one training step of ``job`` through a pipeline engine."""

    def __call__(self, job: Job, /) -> StepResult: ...
