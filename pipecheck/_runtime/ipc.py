"""Ranks on one GPU pass boundary tensors on the device: CUDA IPC, not device -> host -> gloo -> host -> device.

    sharing = sharing_for(ctx)                           # None unless a peer computes on this rank's GPU
    description = sharing.transport.share(tensor)        # sender: a private copy, shared; a small picklable record
    copy = sharing.transport.open(description, device)   # receiver: its own copy; the shared one released
    sharing.transport.collect()                          # sender: frees what receivers have released

``Links`` (comm.py) sends the description through gloo in place of the tensor, one message per leaf slot
under the same tags as before, authenticated with the World's key before it is unpickled or opened.

Lifetimes: the sender shares a fresh copy (nothing of the user's can overwrite it) and drops it at once;
torch's CUDA IPC reference count keeps its memory out of the allocator ("limbo") until the receiver's
copy is made and its handle released (torch synchronizes the receiver's stream first), and
``collect`` (``torch.cuda.ipc_collect``) returns it to the allocator. ``FileTransport`` is the same
protocol through files in shared memory, for tests on machines without a GPU (never chosen by the
product: on CPU, gloo is the transport users' engines use): it is at least as strict, since it frees a
file only once its receiver marked it copied, poisons it before unlinking it, and refuses to open a
file twice or one that is gone.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing.util
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipecheck._world.worker import RankContext
from pipecheck.errors import EngineError

COUNTS: Counter[str] = Counter()  # this process's "shared" and "opened" tensors, for tests and benchmarks


class Transport(Protocol):
    """How a tensor is passed between two processes on one device without the host."""

    def share(self, tensor: torch.Tensor) -> Any:
        """A picklable description of a private copy of ``tensor``, kept alive until its receiver opened it."""

    def open(self, description: Any, device: torch.device) -> torch.Tensor:
        """The receiver's own copy of a shared tensor on ``device``; the shared memory is released."""

    def collect(self) -> None:
        """Free the shared memory that receivers have released (the sender, once a step at least)."""


class CudaTransport:
    """torch's CUDA IPC (``torch.multiprocessing.reductions``): the handle of the memory, its reference
    counter and an event the receiver's stream waits on before it reads."""

    def share(self, tensor: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        private = tensor.detach().clone(memory_format=torch.contiguous_format)
        rebuild, args = reduce_tensor(private)
        assert rebuild is rebuild_cuda_tensor  # a CUDA tensor: torch's own record, the receiver rebuilds it
        return args

    def open(self, description: Any, device: torch.device) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        with torch.cuda.device(device):
            shared = rebuild_cuda_tensor(*description)
            copy = shared.clone()
        del shared  # torch syncs this stream, then gives the sender's memory back to it
        return copy

    def collect(self) -> None:
        torch.cuda.ipc_collect()


_LIVE, _RELEASED = 0, 1
_HEADER = 16  # state (8 bytes), then the nonce the description names (8 bytes)
_POISON = 0xFF
_PREFIX = "pipecheck-ipc-"


@dataclass(frozen=True)
class SharedFile:
    """A tensor in a file of shared memory: what the sender's description names."""

    path: str
    nonce: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class FileTransport:
    """Shared-memory files standing in for CUDA IPC in tests (see the module docstring)."""

    def __init__(self, folder: str | None = None) -> None:
        """``folder``: where the files go (a rank's: its World's folder, which the driver removes)."""
        self.folder = folder or multiprocessing.util.get_temp_dir()
        self.outstanding: dict[str, int] = {}  # path -> nonce: shared, not yet freed
        self._numbers = itertools.count()

    def share(self, tensor: torch.Tensor) -> SharedFile:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        number = next(self._numbers)
        path = os.path.join(self.folder, f"{_PREFIX}{os.getpid()}-{number}")
        nonce = int.from_bytes(os.urandom(8), "little")
        with open(path, "wb") as file:
            file.write(_LIVE.to_bytes(8, "little") + nonce.to_bytes(8, "little"))
            file.write(data.numpy().tobytes() if data.numel() else b"")
        self.outstanding[path] = nonce
        return SharedFile(path, nonce, tuple(tensor.shape), tensor.dtype)

    def open(self, description: Any, device: torch.device) -> torch.Tensor:
        assert isinstance(description, SharedFile)  # authenticated: a rank of this World sent it
        try:
            fd = os.open(description.path, os.O_RDWR)
        except FileNotFoundError:
            raise EngineError(f"shared tensor {description.path} is gone before its receiver copied it: the "
                              "sender freed memory still in use.") from None
        try:
            with mmap.mmap(fd, 0) as memory:
                state, nonce = (int.from_bytes(memory[i:i + 8], "little") for i in (0, 8))
                if state != _LIVE or nonce != description.nonce:
                    raise EngineError(f"shared tensor {description.path} was opened twice or reused "
                                      f"(state {state}, nonce {nonce}, expected {description.nonce}).")
                view = torch.frombuffer(memory, dtype=torch.uint8, offset=_HEADER) if len(memory) > _HEADER \
                    else torch.empty((0,), dtype=torch.uint8)
                copy = view.view(description.dtype).reshape(description.shape).to(device, copy=True)
                del view  # no export of the map may outlive it
                memory[0:8] = _RELEASED.to_bytes(8, "little")
        finally:
            os.close(fd)
        return copy

    def collect(self) -> None:
        for path in list(self.outstanding):
            with open(path, "r+b") as file:
                if int.from_bytes(file.read(8), "little") != _RELEASED:
                    continue  # its receiver has not copied it yet
                size = os.fstat(file.fileno()).st_size
                file.seek(_HEADER)
                file.write(bytes([_POISON]) * (size - _HEADER))  # a late reader would see garbage, not data
            os.unlink(path)
            del self.outstanding[path]


@dataclass(frozen=True)
class Sharing:
    """The peers this rank passes tensors to on the device, and how."""

    transport: Transport
    peers: frozenset[int]


_CUDA = CudaTransport()
_FILES: FileTransport | None = None  # set by use_file_transport: every peer of a CPU rank goes through files


def sharing_for(ctx: RankContext) -> Sharing | None:
    """IPC with the ranks computing on this rank's CUDA device, when they talk through gloo on the host."""
    if _FILES is not None and ctx.device.type == "cpu":
        return Sharing(_FILES, frozenset(r for r in range(ctx.world_size) if r != ctx.rank))
    if ctx.device.type != "cuda" or ctx.comm_device.type != "cpu":
        return None  # CPU ranks (gloo), or NCCL with a GPU per rank
    here = str(ctx.device)
    peers = frozenset(r for r, device in enumerate(ctx.devices) if r != ctx.rank and device == here)
    return Sharing(_CUDA, peers) if peers else None


# --- tasks for tests and benchmarks: world.run(fn) ----------------------------------------------


def use_file_transport(ctx: RankContext, on: bool) -> None:
    """Internal switch (tests): CPU ranks pass tensors through shared-memory files instead of gloo."""
    global _FILES
    if not on and _FILES is not None:
        _FILES.collect()
    _FILES = FileTransport() if on else None
    COUNTS.clear()


def counts(ctx: RankContext) -> dict[str, int]:
    """This rank's tensors "shared" and "opened" (since the switch), and the test transport's files it
    has not freed: as it counts them ("outstanding") and as they are on disk ("files")."""
    if _FILES is None:
        return {"shared": COUNTS["shared"], "opened": COUNTS["opened"], "outstanding": 0, "files": 0}
    mine = f"{_PREFIX}{os.getpid()}-"
    files = sum(name.startswith(mine) for name in os.listdir(_FILES.folder))
    return {"shared": COUNTS["shared"], "opened": COUNTS["opened"], "outstanding": len(_FILES.outstanding),
            "files": files}
