"""Where a check keeps what it has finished: on its accelerator while there is room, else on the host.

    place = Placement.of(device)
    with place.measuring():                  # around the eager step: how much it needed
        eager = eager_step(...)
    eager = place.keep(eager)                # on the host if the device would be crowded by what comes next
    ...
    ref64 = place.keep(ref64); result = place.keep(result)

A check computes three results (eager, the float64 truth, the runner's) and compares them at the end.
Kept on a GPU, they add four to five times the model's parameter bytes to the device beside the steps
still to run (the truth's float64 step, the runner's); moved to the host, the device holds one step at a
time. Moving costs time (a copy out, and one back per row when comparing), so results move only when the
device is tight: when what is free after the eager step is less than what the float64 truth and the
runner will need beside them (measured from the eager step's own peak). On the CPU nothing moves. The
values are the same either way: a copy between devices is exact. Comparing is done a row at a time on
the device (pipecheck._check.numerics compares where the tensors it is given are moved to), so only one
row's tensors are back on it at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult

R = TypeVar("R")

# What the float64 step needs beside the eager step's peak (everything twice the bytes), plus the
# runner's step: the room asked for before results stay on the device, in eager peaks.
STEPS_TO_COME = 2.5


def on_host(value: R) -> R:
    """``value`` with every tensor in it copied to the host (a StepResult: a new one, every field's tensors
    moved, a Truth's error estimate too; the runner's own object is left as it was); the rest as it is."""
    if isinstance(value, StepResult):
        moved = {f.name: on_host(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **moved)
    return pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def result_bytes(result: StepResult) -> int:
    """The bytes a result's tensors hold on an accelerator."""
    leaves = pytree.tree_leaves([getattr(result, f.name) for f in dataclasses.fields(result)])
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu")


@dataclass
class Placement:
    """A check's decision, made once after its eager step, of where finished results stay."""

    device: torch.device
    eager_peak: int = 0  # bytes the eager step needed above what was allocated before it (0: not measured)
    host: bool | None = None  # None: not decided yet

    @classmethod
    def of(cls, device: str | torch.device | None) -> Placement:
        return cls(torch.device(device) if device is not None else torch.device("cpu"))

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Around the eager step: its peak above what was allocated before, where the device's running
        peak shows it (a higher peak earlier in the process hides it: then the parameters' bytes, four
        times, stand for it). The device's peak statistics are not reset (a caller may be measuring)."""
        if not self._cuda:
            yield
            return
        before, peak_before = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
        yield
        peak = torch.cuda.max_memory_allocated(self.device)
        self.eager_peak = peak - before if peak > peak_before else 0

    def keep(self, result: R, model_bytes: int = 0) -> R:
        """``result`` where it stays: on the host if this check's device is tight (decided on the first call)."""
        if not self._cuda or not isinstance(result, StepResult):
            return result
        if self.host is None:
            self.host = self._tight(result_bytes(result), model_bytes)
        return on_host(result) if self.host else result

    def _tight(self, results: int, model_bytes: int) -> bool:
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        need = self.eager_peak or 4 * model_bytes
        return free < STEPS_TO_COME * need + 3 * results  # the truth's (twice eager's bytes) and the runner's


def _exclusive(storage: torch.UntypedStorage) -> bool:
    """Whether one tensor alone holds ``storage`` (the count includes the Python object asked for it)."""
    return bool(torch._C._storage_Use_Count(storage._cdata) <= 2)


@contextmanager
def spilled(tensors: list[torch.Tensor]) -> Iterator[int]:
    """The storages of ``tensors`` emptied for the block, their bytes kept on the host, then put back bit for
    bit (the same storage objects, so every tensor on them is whole again). Only a storage one of
    ``tensors`` alone holds is spilled: one a view, another parameter or anything else also holds stays as
    it is. Yields the bytes freed. (The float64 truth's step spills the parameters' own data while their
    float64 copies run, on a tight accelerator: pipecheck._check.eager.in_dtype.)"""
    held: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
    seen: set[int] = set()
    try:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in seen or not storage.nbytes() or not _exclusive(storage):
                seen.add(key)
                continue
            seen.add(key)
            copy = storage.cpu() if storage.device.type != "cpu" else storage.clone()
            held.append((storage, copy))
            storage.resize_(0)
        yield sum(copy.nbytes() for _, copy in held)
    finally:
        for storage, copy in held:
            storage.resize_(copy.nbytes())
            storage.copy_(copy)
