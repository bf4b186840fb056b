"""The export tracer: torch.export (non-strict), aten-level, with cuts placed from ``nn_module_stack``.

    traced = trace_export(model, args, kwargs, {"layers.2": SplitPoint.BEGINNING})

Handles more Python than fx (HuggingFace models, shape-dependent branches),
and reports what it cannot. Dim 0 of every batched input is dynamic, so
stages run on micro-batches. A custom ``torch.autograd.Function`` is kept as
one call where torch can keep it, and refused by name where it cannot.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.torch_warnings import torch_internal_warnings_ignored
from pipecheck._split.autograd_functions import functions_as_calls, functions_in_export
from pipecheck._split.inputs import bind_signature
from pipecheck._split.markers import PIPE_SPLIT_OP, SplitPoint
from pipecheck._split.microbatch import unwrap_replicated
from pipecheck._split.recipe import ExportBinding
from pipecheck._split.traced import (
    Traced,
    resolve,
    state_assigned_error,
    state_kept,
    try_resolve,
    unused_spec,
)
from pipecheck.errors import TraceError, first_line


def trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint]) -> Traced:
    dynamic_shapes = _batch_dynamic_shapes(bind_signature(model, args, kwargs))  # Replicated: static
    args, kwargs = unwrap_replicated((args, kwargs))
    try:
        with state_kept(model) as assigned, functions_in_export() as functions, torch_internal_warnings_ignored():
            exported = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as err:  # export raises many kinds; the message names the construct
        first = first_line(err)
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}: {type(err).__name__}: {first}\n"
            "Fix: remove data-dependent control flow from forward, or try tracer='fx'."
        ) from None
    if assigned:  # a buffer made on the first call: export leaves a fake tensor in its place
        raise state_assigned_error("torch.export", model, assigned, "")
    gm = functions_as_calls(exported.module())
    graph = gm.graph
    functions.refuse_lost(model, graph)
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    called = _place_spec_markers(graph, split_spec)
    unused_spec(split_spec, called, "export")
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            own = try_resolve(model, node.target)
            attrs[node.target] = own if own is not None else resolve(gm, node.target)
    names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    return Traced(graph, attrs, names, ExportBinding(names, exported.call_spec.in_spec), "export",
                  exported.call_spec.out_spec)


def _batch_dim(value: Any) -> Any:
    """Dim 0 dynamic for a batched tensor; None (static) for the rest, a ``Replicated`` input included."""
    return {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _batch_dynamic_shapes(bound: inspect.BoundArguments) -> dict[str, Any] | None:
    """Dim 0 of every input tensor is dynamic: the stages run on micro-batches, not on the
    full batch the model was exported with (a static trace bakes the batch size into
    reshapes). ``Dim.AUTO`` lets export specialise where the model insists."""
    params = bound.signature.parameters
    if any(params[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
           for name in bound.arguments):
        return None
    return {name: pytree.tree_map(_batch_dim, value) for name, value in bound.arguments.items()}


def _place_spec_markers(graph: fx.Graph, split_spec: dict[str, SplitPoint]) -> set[str]:
    """Insert markers before the first / after the last node run inside each call of each named
    module. A module called twice is cut at both calls, as the fx tracer does; export tells the
    calls apart by their ``nn_module_stack`` keys (``L__self___shared``, ``L__self___shared@1``)."""
    first: dict[tuple[str, str], fx.Node] = {}
    last: dict[tuple[str, str], fx.Node] = {}
    for node in graph.nodes:
        for call, (path, _type) in (node.meta.get("nn_module_stack") or {}).items():
            if path in split_spec:
                first.setdefault((path, call), node)
                last[(path, call)] = node
    for (path, call), node in first.items():
        if split_spec[path] is SplitPoint.BEGINNING:
            with graph.inserting_before(node):
                graph.call_function(PIPE_SPLIT_OP, (), {})
        else:
            with graph.inserting_after(last[(path, call)]):
                graph.call_function(PIPE_SPLIT_OP, (), {})
    return {path for path, _call in first}
