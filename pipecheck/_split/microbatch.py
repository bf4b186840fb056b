"""Split inputs into micro-batches on dim 0 and merge outputs back, as the eager reference does.

    chunks = split_microbatches({"x": x, "mask": mask}, 4)   # list of 4 dicts
    chunks = split_microbatches((x, pc.Replicated(scale)), 4)  # scale goes whole to every micro-batch
    merged = merge_microbatches([out0, out1, out2, out3])

Tensors with a batch dimension are split on dim 0 (it must divide evenly);
0-dim tensors, non-tensors and anything wrapped in :class:`Replicated` go
whole to every micro-batch (unwrapped). Merging concatenates on dim 0; 0-dim
tensors are stacked (shape ``(n,)``) when there is more than one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck.errors import InputError


@dataclass(frozen=True)
class Replicated:
    """An input every micro-batch receives whole, not split on dim 0.

        pc.assert_equivalent(model, (x, pc.Replicated(scale)), n_microbatches=4)

    For inputs without a batch dimension: a per-feature scale of shape ``(d,)``,
    a ``(1,)`` flag, a shared table. The model is called with the value itself;
    its gradient (if it requires one) is the sum over micro-batches, as in eager.
    """

    value: Any

    def __repr__(self) -> str:
        return f"pc.Replicated({self.value!r})"


def unwrap_replicated(value: Any) -> Any:
    """``value`` with every :class:`Replicated` replaced by what it wraps."""
    return pytree.tree_map(lambda leaf: leaf.value if isinstance(leaf, Replicated) else leaf, value)


def replicated_names(named: dict[str, Any]) -> frozenset[str]:
    """The names in ``named`` (e.g. bound inputs) whose value is wrapped in :class:`Replicated`."""
    return frozenset(name for name, value in named.items() if isinstance(value, Replicated))


def _path(keypath: tuple[Any, ...]) -> str:
    return pytree.keystr(keypath)  # "" for a bare tensor: the message reads "target has ..."


def split_microbatches(value: Any, n_microbatches: int, what: str = "input", *, uneven: bool = False) -> list[Any]:
    """``value`` in ``n_microbatches`` pieces on dim 0; ``uneven``: sizes may differ by one (as
    ``torch.tensor_split`` cuts), for a loss convention that does not weigh micro-batches equally."""
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise InputError(f"n_microbatches={n_microbatches!r} must be a positive int.")
    leaves, spec = pytree.tree_flatten_with_path(value)
    columns: list[list[Any]] = []
    for keypath, leaf in leaves:
        if isinstance(leaf, Replicated):
            columns.append([leaf.value] * n_microbatches)
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            batch = leaf.shape[0]
            if uneven and batch < n_microbatches:
                raise InputError(f"{what}{_path(keypath)} has batch size {batch} on dim 0, fewer than "
                                 f"n_microbatches={n_microbatches}: a micro-batch would be empty. Fix: a smaller "
                                 "n_microbatches, or a larger batch.")
            if batch % n_microbatches and not uneven:
                raise InputError(
                    f"{what}{_path(keypath)} has batch size {batch} on dim 0, not divisible by "
                    f"n_microbatches={n_microbatches}. Fix: use a batch size that is a multiple of "
                    f"{n_microbatches}, or an n_microbatches that divides {batch}; if {what}{_path(keypath)} "
                    f"has no batch dimension (shape {tuple(leaf.shape)}), pass it as pc.Replicated(value): "
                    "every micro-batch then gets it whole."
                )
            chunks = leaf.tensor_split(n_microbatches) if uneven else leaf.split(batch // n_microbatches)
            # Views of one tensor share its version counter: a forward that writes into its input
            # (``x.mul_(2)``) would invalidate what autograd saved from the micro-batches before it.
            columns.append([chunk.clone() for chunk in chunks] if n_microbatches > 1 else list(chunks))
        else:
            columns.append([leaf] * n_microbatches)
    return [pytree.tree_unflatten([col[m] for col in columns], spec) for m in range(n_microbatches)]


def merge_microbatches(values: list[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    flat = [pytree.tree_flatten(v) for v in values]
    spec = flat[0][1]
    merged = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.cat(column) if first.dim() > 0 else torch.stack(column))
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)


def shard_batch(value: Any, n_shards: int, uneven: bool = False, what: str = "input") -> list[Any]:
    """``value`` cut on dim 0 into ``n_shards`` data-parallel shards, each still a whole batch: unlike
    :func:`split_microbatches`, a :class:`Replicated` input stays wrapped (every shard gets it, and
    its micro-batches will too)."""
    if n_shards == 1:
        return [value]
    leaves, spec = pytree.tree_flatten(value, is_leaf=lambda leaf: isinstance(leaf, Replicated))
    batched = [leaf if not isinstance(leaf, Replicated) else None for leaf in leaves]
    pieces = split_microbatches(batched, n_shards, what, uneven=uneven)
    return [pytree.tree_unflatten([leaf if isinstance(leaf, Replicated) else piece[i]
                                   for i, leaf in enumerate(leaves)], spec) for piece in pieces]
