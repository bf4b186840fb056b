"""Point-to-point transfer of stage values and their gradients between ranks.

    link = Links(pipe, stage_to_rank, ctx.device, ctx.comm_device)
    link.send_value(producer, name, consumer, mb, value)    # forward: after F
    value = link.finish_value(link.post_value(producer, name, consumer, mb))   # before F
    link.send_grads(...); link.finish_grads(link.post_grads(...))              # backward, the other way

Every message has its own tag (channel, micro-batch, direction, leaf), so
messages never match the wrong receive whatever order ranks run in. A value's
layout (pytree structure, shapes, dtypes, requires_grad, non-tensor leaves) is
sent on the channel's first use (its length, then its pickle, each with an HMAC tag
under the World's key that binds it to its channel and micro-batch, checked before
anything is allocated or unpickled) and cached on both sides (for the life of the
Links, so repeated steps skip it); again with every micro-batch only when the
value holds non-tensor leaves. Once a layout is known, the receives of a later
action can be posted ahead of time (``post_value`` / ``post_grads``) and
waited on when the action runs (``finish_value`` / ``finish_grads``). Gradients need no
layout: the producer knows its own outputs' shapes, and every leaf that
requires grad gets a tensor (zeros where the consumer produced none).

Between ranks that compute on one GPU and talk through gloo, a tensor leaf's message is instead a
description of a CUDA IPC share of it (ipc.py), in a fixed-size frame under the same tag, with its
own HMAC checked before it is unpickled or opened; the receiver copies the shared tensor on the device.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from pipecheck._runtime.ipc import COUNTS, Sharing
from pipecheck._runtime.stage_step import LeafGrads
from pipecheck._split.pipe import Pipe
from pipecheck.errors import EngineError

_TAG_BYTES = 32  # HMAC-SHA256 of a layout's pickle, before it
_SIZE_BYTES = 8  # a layout's length, little-endian, then its own HMAC: checked before anything is allocated
MAX_LAYOUT_BYTES = 1 << 30  # what a receiver allocates at most for one layout, key or no key
LEAF_SLOTS = 64  # tags reserved per message: 0 = layout size, 1 = layout bytes, 2.. = tensor leaves
SHARE_BYTES = 1024  # one shared tensor's frame: HMAC, length, the description's pickle, zeros


@dataclass(frozen=True)
class Layout:
    """How to rebuild a value from its received tensor leaves."""

    spec: str  # pytree.treespec_dumps: pickling a TreeSpec itself is deprecated
    leaves: tuple[Any, ...]  # (shape, dtype, requires_grad) for tensors, else the value itself
    is_tensor: tuple[bool, ...]

    @property
    def resend(self) -> bool:
        return not all(self.is_tensor)


@functools.lru_cache(maxsize=1024)
def _spec(text: str) -> pytree.TreeSpec:
    """Decoded once per distinct structure, not once per received micro-batch."""
    return pytree.treespec_loads(text)


def layout_of(value: Any) -> Layout:
    leaves, spec = pytree.tree_flatten(value)
    described = tuple((tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else v
                      for v in leaves)
    return Layout(pytree.treespec_dumps(spec), described, tuple(isinstance(v, torch.Tensor) for v in leaves))


Channel = tuple[int, str, int]  # (producer stage, value name, consumer stage): one value to one consumer


@dataclass
class Posted:
    """Receives posted for one value (or one value's gradient), not yet waited on."""

    layout: Layout | None = None
    value: Any = None  # for gradients: the output whose gradient is coming
    works: list[Any] = field(default_factory=list)
    buffers: list[torch.Tensor | SharedSlot] = field(default_factory=list)


@dataclass(frozen=True)
class SharedSlot:
    """A leaf that comes as a shared tensor's description: the frame, and what it must hold."""

    frame: torch.Tensor
    channel: Channel
    src: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class Links:
    """The p2p channels of one rank, for one step."""

    def __init__(self, pipe: Pipe, stage_to_rank: tuple[int, ...], device: torch.device,
                 comm_device: torch.device, secret: bytes = b"", sharing: Sharing | None = None) -> None:
        """``sharing``: the ranks this one passes tensors to on the device (ipc.py), and how."""
        self.stage_to_rank = stage_to_rank
        self.sharing = sharing
        self.secret = secret  # the World's key (a torchrun job's ranks share none: integrity only)
        self.device = device
        self.comm_device = comm_device
        channels = sorted({(e.src, e.name, e.dst) for e in pipe.edges if e.src is not None},
                          key=lambda c: (c[0], c[2], c[1]))
        self.channel_ids = {channel: i for i, channel in enumerate(channels)}
        self.layouts: dict[int, Layout] = {}  # received, by channel id; kept across steps
        self.every_microbatch = False  # micro-batches of unequal size: layouts travel with each one
        self.sent_layouts: dict[int, Layout] = {}
        self.pending: list[Any] = []

    def signed(self, blob: bytes, tag: int) -> bytes:
        return self._mac(blob, tag) + blob

    def _mac(self, blob: bytes, tag: int) -> bytes:
        return hmac.new(self.secret, tag.to_bytes(8, "little") + blob, hashlib.sha256).digest()

    def verified(self, payload: bytes, channel: Channel, src: int, tag: int, what: str = "layout") -> bytes:
        """The bytes in ``payload`` if its tag is this World's, checked before they are used: a process
        outside the World that connects to a rank's port cannot make it run code or allocate."""
        mac, blob = payload[:_TAG_BYTES], payload[_TAG_BYTES:]
        if not hmac.compare_digest(mac, self._mac(blob, tag)):
            producer, name, consumer = channel
            raise EngineError(
                f"the {what} of value {name!r} (stage {producer} to stage {consumer}), received from rank {src}, "
                "failed authentication: it was not sent by a rank of this World, and was not used. Another "
                "process reached this rank's port. Fix: run pipecheck where other users cannot connect to its "
                "ranks' ports, or find the process that did."
            )
        return blob

    def _receive_layout(self, channel: Channel, mb: int, src: int) -> Layout:
        size_tag, layout_tag = self._tag(channel, mb, False, 0), self._tag(channel, mb, False, 1)
        header = torch.empty((_TAG_BYTES + _SIZE_BYTES,), dtype=torch.uint8, device=self.comm_device)
        dist.recv(header, src, tag=size_tag)
        size_bytes = self.verified(bytes(header.cpu().tolist()), channel, src, size_tag, "layout's size")
        size = int.from_bytes(size_bytes, "little", signed=True)
        if not _TAG_BYTES < size <= MAX_LAYOUT_BYTES:
            producer, name, consumer = channel
            raise EngineError(
                f"the layout of value {name!r} (stage {producer} to stage {consumer}), received from rank {src}, "
                f"claims {size} bytes: a layout holds between {_TAG_BYTES + 1} and {MAX_LAYOUT_BYTES} bytes, so "
                "nothing was allocated. Without a World's key (under torchrun) any process that reaches a rank's "
                "port can send this. Fix: run pipecheck where other users cannot connect to its ranks' ports."
            )
        payload = torch.empty((size,), dtype=torch.uint8, device=self.comm_device)
        dist.recv(payload, src, tag=layout_tag)
        layout = pickle.loads(self.verified(bytes(payload.cpu().tolist()), channel, src, layout_tag))
        assert isinstance(layout, Layout)  # authenticated: a rank of this World pickled it
        return layout

    def _tag(self, channel: Channel, mb: int, backward: bool, slot: int) -> int:
        cid = self.channel_ids[channel]
        return ((mb * len(self.channel_ids) + cid) * 2 + int(backward)) * LEAF_SLOTS + slot

    def _shares_with(self, rank: int) -> bool:
        return self.sharing is not None and rank in self.sharing.peers

    def _send_leaf(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """A tensor leaf: itself, or to a rank on this GPU the frame that shares it."""
        self._isend(self._shared_frame(tensor, tag) if self._shares_with(dst) else tensor, dst, tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.pending.append(dist.isend(tensor.detach().to(self.comm_device).contiguous(), dst, tag=tag))

    def _shared_frame(self, tensor: torch.Tensor, tag: int) -> torch.Tensor:
        """The frame that passes ``tensor`` by IPC: its description's pickle, signed for this tag."""
        assert self.sharing is not None
        blob = pickle.dumps(self.sharing.transport.share(tensor))
        COUNTS["shared"] += 1
        frame = self._mac(blob, tag) + len(blob).to_bytes(_SIZE_BYTES, "little") + blob
        if len(frame) > SHARE_BYTES:  # torch's record is a few hundred bytes whatever the tensor's size
            raise EngineError(f"a shared tensor's description takes {len(frame)} bytes, more than the "
                              f"{SHARE_BYTES} a frame holds (shape {tuple(tensor.shape)}). This is pipecheck's "
                              "bug: please report it; World(device='cpu') avoids this path.")
        return torch.frombuffer(bytearray(frame.ljust(SHARE_BYTES, b"\0")), dtype=torch.uint8)

    def _irecv(self, posted: Posted, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
               channel: Channel) -> None:
        if self._shares_with(src):
            frame = torch.empty((SHARE_BYTES,), dtype=torch.uint8, device=self.comm_device)
            posted.works.append(dist.irecv(frame, src, tag=tag))
            posted.buffers.append(SharedSlot(frame, channel, src, tag, shape, dtype))
            return
        buffer = torch.empty(shape, dtype=dtype, device=self.comm_device)
        posted.works.append(dist.irecv(buffer, src, tag=tag))
        posted.buffers.append(buffer)

    def _opened(self, slot: SharedSlot) -> torch.Tensor:
        """This rank's copy of the tensor a peer shared, once the frame proves it came from the World."""
        assert self.sharing is not None
        frame = bytes(slot.frame.tolist())
        size = int.from_bytes(frame[_TAG_BYTES:_TAG_BYTES + _SIZE_BYTES], "little")
        start = _TAG_BYTES + _SIZE_BYTES
        payload = frame[:_TAG_BYTES] + frame[start:start + min(size, SHARE_BYTES - start)]
        description = pickle.loads(self.verified(payload, slot.channel, slot.src, slot.tag, "shared tensor"))
        tensor = self.sharing.transport.open(description, self.device)
        COUNTS["opened"] += 1
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            producer, name, consumer = slot.channel
            raise EngineError(
                f"value {name!r} (stage {producer} to stage {consumer}) came from rank {slot.src} as a tensor of "
                f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}, where its layout says {slot.shape} and "
                f"{slot.dtype}. This is pipecheck's bug: please report it; World(device='cpu') avoids this path.")
        return tensor

    def _needs_layout(self, cid: int, known: dict[int, Layout]) -> bool:
        """A layout travels on a channel's first use, and every time if the value has non-tensor leaves
        or the micro-batches differ in size (every rank of the step knows that alike)."""
        return cid not in known or known[cid].resend or self.every_microbatch

    def send_value(self, producer: int, name: str, consumer: int, mb: int, value: Any) -> None:
        channel = (producer, name, consumer)
        dst = self.stage_to_rank[consumer]
        tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        if len(tensors) > LEAF_SLOTS - 2:
            raise EngineError(f"value {name!r} of stage {producer} has {len(tensors)} tensors; "
                              f"at most {LEAF_SLOTS - 2} can cross a stage boundary as one value.")
        cid = self.channel_ids[channel]
        if not self._needs_layout(cid, self.sent_layouts):
            self._check_layout(self.sent_layouts[cid], value, channel, mb)
        else:
            layout = layout_of(value)
            self.sent_layouts[cid] = layout
            size_tag, layout_tag = self._tag(channel, mb, False, 0), self._tag(channel, mb, False, 1)
            signed = self.signed(pickle.dumps(layout), layout_tag)
            header = self.signed(len(signed).to_bytes(_SIZE_BYTES, "little", signed=True), size_tag)
            self._isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, size_tag)
            self._isend(torch.frombuffer(bytearray(signed), dtype=torch.uint8), dst, layout_tag)
        for i, tensor in enumerate(tensors):
            self._send_leaf(tensor, dst, self._tag(channel, mb, False, 2 + i))

    @staticmethod
    def _check_layout(sent: Layout, value: Any, channel: Channel, mb: int) -> None:
        """The receiver allocates from the cached layout: a value whose shape changes between
        micro-batches (data-dependent shapes) must fail here, clearly, not corrupt its buffers."""
        leaves = pytree.tree_leaves(value)
        if len(leaves) == len(sent.leaves) and all(
                (tuple(v.shape), v.dtype, v.requires_grad) == described if is_tensor else v == described
                for v, described, is_tensor in zip(leaves, sent.leaves, sent.is_tensor)):
            return  # the common case, without re-serialising the structure
        now = layout_of(value)
        if now.leaves != sent.leaves or now.spec != sent.spec:
            producer, name, consumer = channel
            shapes = [leaf[0] for leaf, is_tensor in zip(now.leaves, now.is_tensor) if is_tensor]
            before = [leaf[0] for leaf, is_tensor in zip(sent.leaves, sent.is_tensor) if is_tensor]
            raise EngineError(
                f"value {name!r} sent from stage {producer} to stage {consumer} changed its layout at "
                f"micro-batch {mb}: shapes {shapes}, earlier {before}. pipecheck's runtime needs each value "
                "that crosses a stage boundary to keep its shapes and dtypes across micro-batches. Fix: cut "
                "where values have a fixed shape (not after a data-dependent filter), or use n_microbatches=1."
            )

    def can_post_value(self, producer: int, name: str, consumer: int) -> bool:
        """True when the value's layout is known, so its receives can be posted ahead of time."""
        return not self._needs_layout(self.channel_ids[(producer, name, consumer)], self.layouts)

    def post_value(self, producer: int, name: str, consumer: int, mb: int) -> Posted:
        """Post the receives of one value (blocking only for a layout it has not seen yet)."""
        channel = (producer, name, consumer)
        src = self.stage_to_rank[producer]
        cid = self.channel_ids[channel]
        if self._needs_layout(cid, self.layouts):
            self.layouts[cid] = self._receive_layout(channel, mb, src)
        layout = self.layouts[cid]
        posted = Posted(layout=layout)
        slot = 2
        for described, is_tensor in zip(layout.leaves, layout.is_tensor):
            if is_tensor:
                shape, dtype, _ = described
                self._irecv(posted, shape, dtype, src, self._tag(channel, mb, False, slot), channel)
                slot += 1
        return posted

    def finish_value(self, posted: Posted) -> Any:
        layout = posted.layout
        assert layout is not None
        received = iter(self._wait(posted))
        leaves = [next(received).requires_grad_(described[2]) if is_tensor else described
                  for described, is_tensor in zip(layout.leaves, layout.is_tensor)]
        return pytree.tree_unflatten(leaves, _spec(layout.spec))

    def send_grads(self, producer: int, name: str, consumer: int, mb: int, value: Any, grads: LeafGrads) -> None:
        """Send the gradient of every leaf of ``value`` (this stage's input) that requires grad."""
        channel = (producer, name, consumer)
        dst = self.stage_to_rank[producer]
        slot = 2
        for leaf, grad in zip(pytree.tree_leaves(value), grads):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                self._send_leaf(grad if grad is not None else torch.zeros_like(leaf), dst,
                            self._tag(channel, mb, True, slot))
                slot += 1

    def post_grads(self, producer: int, name: str, consumer: int, mb: int, value: Any) -> Posted:
        """Post the receives of the gradient of ``value`` (this stage's output) from ``consumer``."""
        channel = (producer, name, consumer)
        src = self.stage_to_rank[consumer]
        posted = Posted(value=value)
        slot = 2
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                self._irecv(posted, tuple(leaf.shape), leaf.dtype, src, self._tag(channel, mb, True, slot),
                            channel)
                slot += 1
        return posted

    def finish_grads(self, posted: Posted) -> LeafGrads:
        received = iter(self._wait(posted))
        return [next(received) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
                for leaf in pytree.tree_leaves(posted.value)]

    def _wait(self, posted: Posted) -> list[torch.Tensor]:
        for work in posted.works:
            work.wait()
        return [self._opened(buffer) if isinstance(buffer, SharedSlot) else buffer.to(self.device)
                for buffer in posted.buffers]

    def wait_sends(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        if self.sharing is not None:
            self.sharing.transport.collect()  # what receivers copied in this step (or the last)
