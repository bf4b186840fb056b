"""Trace a model into one flat ``fx.Graph`` whose stage cuts are marker nodes.

    traced = trace(model_copy, args, kwargs, split_spec={"layers.2": SplitPoint.BEGINNING})
    traced.graph          # placeholders, get_attr, compute nodes, pipe_split markers, output
    traced.input_names    # model inputs that are graph placeholders, in order

Two tracers: ``"fx"`` (torch.fx symbolic tracing; fast, keeps leaf modules as
``call_module``) and ``"export"`` (torch.export, aten-level). Split specs are
applied without touching the model: the fx tracer inserts markers around the
named module's call; for export they are placed from ``nn_module_stack``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._errors import InputError, SplitError, TraceError
from pipecheck._inputs import bind_signature
from pipecheck._markers import PIPE_SPLIT_OP, SplitPoint, _active_fx_tracer, pipe_split
from pipecheck._torch_warnings import torch_internal_warnings_ignored

SplitSpec = Mapping[str, "SplitPoint | str"]


@dataclass
class Traced:
    """A traced model: one graph, the objects its ``get_attr`` targets name, and its I/O layout."""

    graph: fx.Graph
    attrs: dict[str, Any]  # get_attr / call_module target -> object (from the model copy)
    input_names: tuple[str, ...]
    bind: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]
    tracer: str
    out_spec: pytree.TreeSpec | None = None  # export: the graph returns flat leaves in this structure


def normalize_split_spec(model: nn.Module, split_spec: SplitSpec) -> dict[str, SplitPoint]:
    """Check every FQN names a submodule and every point is a SplitPoint; report all problems."""
    modules = dict(model.named_modules())
    problems: list[str] = []
    spec: dict[str, SplitPoint] = {}
    for fqn, point in split_spec.items():
        if fqn not in modules or fqn == "":
            close = difflib.get_close_matches(fqn, [m for m in modules if m], n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"  {fqn!r} is not a submodule of {type(model).__name__}.{hint}")
            continue
        try:
            spec[fqn] = point if isinstance(point, SplitPoint) else SplitPoint(str(point).upper())
        except ValueError:
            problems.append(f"  {fqn!r}: split point {point!r} is not SplitPoint.BEGINNING or SplitPoint.END")
    if problems:
        raise SplitError(
            "split_spec has problems:\n" + "\n".join(problems)
            + "\nFix: use module FQNs as printed by model.named_modules(), mapped to SplitPoint.BEGINNING/END."
        )
    return spec


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


class _SplitTracer(fx.Tracer):
    """An fx tracer that puts a ``pipe_split`` node before/after each module named in the spec."""

    def __init__(self, split_spec: dict[str, SplitPoint]) -> None:
        # Buffers as get_attr nodes, not folded into constants: a stage must read the
        # buffer itself (it may change between steps), and str(pipe) must list it.
        super().__init__(param_shapes_constant=False)
        self.proxy_buffer_attributes = True
        self.split_spec = split_spec
        self.called: set[str] = set()

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        point = self.split_spec.get(path)
        self.called.add(path)
        if point is SplitPoint.BEGINNING:
            self.create_proxy("call_function", pipe_split, (), {})
        out = super().call_module(m, forward, args, kwargs)
        if point is SplitPoint.END:
            self.create_proxy("call_function", pipe_split, (), {})
        return out


def _drop_specialized(graph: fx.Graph, sig: inspect.Signature, specialized: set[str]) -> None:
    """Remove placeholders fx keeps for concrete args (renamed ``x_1``), with their guards.

    fx makes one placeholder per signature parameter, in signature order.
    """
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for param, node in zip(params, placeholders):
        if param.name in specialized:
            for user in list(node.users):
                for guard in list(user.users):
                    graph.erase_node(guard)
                graph.erase_node(user)
            graph.erase_node(node)


def _unused_spec(split_spec: dict[str, SplitPoint], called: set[str], tracer: str) -> None:
    unused = [fqn for fqn in split_spec if fqn not in called]
    if unused:
        raise SplitError(
            f"split_spec names modules that forward never calls: {unused}. "
            f"Fix: cut at a module that runs in forward (seen by the {tracer!r} tracer)."
        )


def trace_fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint]) -> Traced:
    bound = bind_signature(model, args, kwargs)
    sig = bound.signature
    graph_inputs = [name for name, value in bound.arguments.items() if _has_tensor(value)]
    concrete = {
        name: (bound.arguments[name] if name in bound.arguments else param.default)
        for name, param in sig.parameters.items()
        if name not in graph_inputs and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
    }
    tracer = _SplitTracer(split_spec)
    _active_fx_tracer.append(tracer)
    try:
        graph = tracer.trace(model, concrete_args=concrete)
    except Exception as err:  # fx raises many kinds; the message names the construct
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__}: {type(err).__name__}: {err}\n"
            "Fix: remove data-dependent control flow from forward, or try tracer='export' "
            "(torch.export handles more Python, and reports what it cannot)."
        ) from None
    finally:
        _active_fx_tracer.pop()
    _unused_spec(split_spec, tracer.called, "fx")
    _drop_specialized(graph, sig, set(concrete))
    attrs = {n.target: _resolve(model, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    names = tuple(n.target for n in graph.nodes if n.op == "placeholder")

    def bind(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> dict[str, Any]:
        b = bind_signature(model, call_args, call_kwargs)
        _check_concrete(b, concrete, graph_inputs)
        return {name: b.arguments[name] for name in names}

    return Traced(graph, attrs, names, bind, "fx")


def _check_concrete(bound: inspect.BoundArguments, concrete: dict[str, Any], graph_inputs: list[str]) -> None:
    """Non-tensor arguments (and kwargs left to their defaults) are fixed when the model is traced:
    a call with other values would silently run the traced ones."""
    problems = []
    for name, traced in concrete.items():
        value = bound.arguments.get(name, bound.signature.parameters[name].default)
        if _has_tensor(value):
            problems.append(f"{name} is a tensor now, but was {traced!r} when traced")
            continue
        try:
            same = value is traced or bool(value == traced)
        except Exception:
            same = False
        if not same:
            problems.append(f"{name}={value!r}, traced with {name}={traced!r}")
    missing = [name for name in graph_inputs if name not in bound.arguments]
    problems += [f"{name} is missing; it was a tensor input when traced" for name in missing]
    if problems:
        raise InputError("inputs differ from the ones the model was split with (non-tensor arguments and "
                         "defaults are fixed at split time): " + "; ".join(problems)
                         + ". Fix: split again with these inputs.")


def _resolve(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _try_resolve(root: nn.Module, target: str) -> Any:
    try:
        return _resolve(root, target)
    except AttributeError:
        return None


def trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint]) -> Traced:
    bound = bind_signature(model, args, kwargs)
    try:
        with torch_internal_warnings_ignored():
            exported = torch.export.export(model, args, kwargs, strict=False,
                                           dynamic_shapes=_batch_dynamic_shapes(bound))
    except Exception as err:  # export raises many kinds; the message names the construct
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}: {type(err).__name__}: {first}\n"
            "Fix: remove data-dependent control flow from forward, or try tracer='fx'."
        ) from None
    gm = exported.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    called = _place_spec_markers(graph, split_spec)
    _unused_spec(split_spec, called, "export")
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            own = _try_resolve(model, node.target)
            attrs[node.target] = own if own is not None else _resolve(gm, node.target)
    names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    in_spec = exported.call_spec.in_spec

    def bind(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> dict[str, Any]:
        bind_signature(model, call_args, call_kwargs)
        leaves, spec = pytree.tree_flatten((tuple(call_args), dict(call_kwargs)))
        if spec != in_spec:
            raise InputError(
                "inputs have a different structure from the ones the model was exported with. "
                "Fix: pass the same positional args and kwargs as to pc.split."
            )
        return dict(zip(names, leaves))

    return Traced(graph, attrs, names, bind, "export", exported.call_spec.out_spec)


def _batch_dim(value: Any) -> Any:
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


TRACERS: dict[str, Callable[[nn.Module, tuple[Any, ...], dict[str, Any], dict[str, SplitPoint]], Traced]] = {
    "fx": trace_fx,
    "export": trace_export,
}


def check_tracer(tracer: str) -> None:
    if tracer not in TRACERS:
        raise SplitError(f"tracer={tracer!r} is not known. Fix: use tracer='fx' (default) or tracer='export'.")


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint],
          tracer: str) -> Traced:
    check_tracer(tracer)
    return TRACERS[tracer](model, args, kwargs, split_spec)
