"""Trace a model into one flat ``fx.Graph`` whose stage cuts are marker nodes.

    traced = trace(model_copy, args, kwargs, split_spec={"layers.2": SplitPoint.BEGINNING}, tracer="auto")

Two tracers: ``"fx"`` (torch.fx symbolic tracing, ``pipecheck._split.trace_fx``; fast,
keeps leaf modules as ``call_module``) and ``"export"`` (torch.export,
``pipecheck._split.trace_export``; aten-level, handles more Python). ``"auto"`` (the
default) takes fx and falls back to export where fx cannot trace. Split specs
are applied without touching the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.checkpoints import checkpoints_marked
from pipecheck._split.markers import SplitPoint
from pipecheck._split.microbatch import unwrap_replicated
from pipecheck._split.model_factory import buffers_kept, seeded
from pipecheck._split.trace_export import trace_export
from pipecheck._split.trace_fx import trace_fx
from pipecheck._split.traced import Traced, unknown_output_error
from pipecheck.errors import SplitError, TraceError

TRACERS: dict[str, Callable[[nn.Module, tuple[Any, ...], dict[str, Any], dict[str, SplitPoint]], Traced]] = {
    "fx": trace_fx,
    "export": trace_export,
}
TRACER_NAMES = ("auto", *TRACERS)


def check_tracer(tracer: str) -> None:
    if tracer not in TRACER_NAMES:
        raise SplitError(f"tracer={tracer!r} is not known. Fix: use tracer='auto' (the default: fx, or export "
                         "where fx cannot trace), tracer='fx' or tracer='export'.")


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint],
          tracer: str) -> Traced:
    """Trace with ``tracer``; ``"auto"`` tries fx first and export where fx cannot trace.

    Where tracing fails because ``forward`` returns an object no tracer can describe, the error
    says so (found by one eager call, only then).
    """
    check_tracer(tracer)
    order = ("fx", "export") if tracer == "auto" else (tracer,)
    failures: list[TraceError] = []
    for name in order:
        try:
            # seeded: a forward that draws (Python's random, numpy) leaves the caller's RNGs as they were;
            # checkpoints_marked: each torch.utils.checkpoint region is recorded, to be recomputed by the stages
            with seeded(0), checkpoints_marked():
                return TRACERS[name](model, args, kwargs, split_spec)
        except TraceError as err:
            failures.append(err)
    _refuse_unsupported_output(model, args, kwargs)
    if len(failures) == 1:
        raise failures[0]
    raise TraceError(
        f"neither tracer could trace {type(model).__name__} (tracer='auto' tried fx, then export):\n"
        + "\n".join(f"  {name}: {str(err).splitlines()[0]}" for name, err in zip(order, failures))
        + "\nFix: make forward traceable by one of them (no data-dependent Python control flow for export; "
        "no Python logic on tensor values for fx)."
    )


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


def _refuse_unsupported_output(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A SplitError naming the class when ``forward`` returns an object torch's pytree does not know."""
    try:
        with seeded(0), buffers_kept(model), torch.no_grad():  # the caller's RNG and buffers untouched
            outputs = model(*unwrap_replicated(args), **unwrap_replicated(kwargs))
    except Exception:
        return  # the model fails eagerly too: the trace error says more
    odd = sorted({type(leaf).__qualname__ for leaf in pytree.tree_leaves(outputs) if not isinstance(leaf, _PLAIN_LEAVES)})
    if odd:
        raise unknown_output_error(model, odd)
