"""Split inputs into micro-batches on dim 0 and merge outputs back, as the eager reference does.

    chunks = split_microbatches({"x": x, "mask": mask}, 4)   # list of 4 dicts
    merged = merge_microbatches([out0, out1, out2, out3])

Tensors with a batch dimension are split on dim 0 (it must divide evenly);
0-dim tensors and non-tensors go whole to every micro-batch. Merging
concatenates on dim 0; 0-dim tensors are stacked (shape ``(n,)``) when there
is more than one micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._errors import InputError


def _path(keypath: tuple[Any, ...]) -> str:
    return pytree.keystr(keypath)  # "" for a bare tensor: the message reads "target has ..."


def split_microbatches(value: Any, n_microbatches: int, what: str = "input") -> list[Any]:
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise InputError(f"n_microbatches={n_microbatches!r} must be a positive int.")
    leaves, spec = pytree.tree_flatten_with_path(value)
    columns: list[list[Any]] = []
    for keypath, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            batch = leaf.shape[0]
            if batch % n_microbatches:
                raise InputError(
                    f"{what}{_path(keypath)} has batch size {batch} on dim 0, not divisible by "
                    f"n_microbatches={n_microbatches}. Fix: use a batch size that is a multiple of "
                    f"{n_microbatches}, or an n_microbatches that divides {batch}."
                )
            columns.append(list(leaf.split(batch // n_microbatches)))
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
