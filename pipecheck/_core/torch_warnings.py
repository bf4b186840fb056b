"""Warnings torch raises from inside calls pipecheck makes for the user, filtered only around them.

    with torch_internal_warnings_ignored():
        exported = torch.export.export(model, args, kwargs)

Each is about torch's own machinery, not about anything the user can change, and
only these messages are ignored, only for the duration of the call: the user's own
warnings, and these same warnings from the user's own torch calls, still show.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

TORCH_INTERNAL: tuple[tuple[type[Warning], str], ...] = (
    # torch copies its own TreeSpecs (export, pipelining's pipeline()); the deprecation is torch's.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # torch.export restores such attributes after tracing; pipecheck never hands the export to the user.
    (UserWarning, r"The tensor attributes? .* (was|were) assigned during export"),
    # autograd's device thread on CUDA; torch sets the primary context itself and goes on.
    (UserWarning, r"Attempting to run cuBLAS, but there was no current CUDA context"),
)


@contextmanager
def torch_internal_warnings_ignored() -> Iterator[None]:
    """Run a block with the warnings of :data:`TORCH_INTERNAL` ignored (and nothing else)."""
    with warnings.catch_warnings():
        for category, message in TORCH_INTERNAL:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
