"""The fx tracer: torch.fx symbolic tracing, with cuts from ``pipe_split()`` and split specs.

    traced = trace_fx(model, args, kwargs, {"layers.2": SplitPoint.BEGINNING})

Fast, and keeps ``torch.nn`` modules as ``call_module`` nodes. Only inputs
that hold tensors become graph inputs, named by parameter (and by keyword for
``**kwargs`` entries); every other argument is passed to ``forward`` as given,
and a parameter not passed keeps ``forward``'s own default, so later calls must
agree with what the graph fixed. A custom ``torch.autograd.Function`` is one
call node, so its own backward runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.autograd_functions import functions_as_calls_in_fx
from pipecheck._split.inputs import bind_signature
from pipecheck._split.markers import (
    SplitPoint,
    _active_fx_tracer,
    pipe_split,
    torch_markers_recorded,
)
from pipecheck._split.microbatch import unwrap_replicated
from pipecheck._split.traced import (
    Traced,
    has_tensor,
    resolve,
    state_assigned_error,
    state_kept,
    unknown_output_error,
    unused_spec,
)
from pipecheck.errors import InputError, TraceError


@dataclass(frozen=True)
class _GraphInput:
    """Stands for a model input that becomes a graph placeholder, while fx traces forward."""

    name: str


class _SplitTracer(fx.Tracer):
    """An fx tracer that puts a ``pipe_split`` node before/after each module named in the spec."""

    def __init__(self, split_spec: dict[str, SplitPoint], root_call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        # Buffers as get_attr nodes, not folded into constants: a stage must read the
        # buffer itself (it may change between steps), and str(pipe) must list it.
        super().__init__(param_shapes_constant=False)
        self.proxy_buffer_attributes = True
        self.split_spec = split_spec
        self.called: set[str] = set()
        self.root_call = root_call  # forward's (args, kwargs): graph inputs as _GraphInput, the rest as given

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> tuple[Any, list[Any]]:
        """One placeholder per graph input; forward is called with keywords, never re-signed.

        fx's own version reads the parameter names off ``inspect.unwrap(forward)`` but rewrites the
        code object of the *outer* function: a forward decorated with ``functools.wraps`` whose
        wrapped function has ``**kwargs`` (every HuggingFace model) fails with ``co_varnames is too
        small``, and a plain ``**kwargs`` forward gets a placeholder named ``**kwargs``.
        """
        if not is_module:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        call_args, call_kwargs = self.root_call

        def value(v: Any) -> Any:
            return self.create_proxy("placeholder", v.name, (), {}) if isinstance(v, _GraphInput) else v

        args = [value(v) for v in call_args]
        kwargs = {k: value(v) for k, v in call_kwargs.items()}

        def forward(root: nn.Module) -> Any:
            return root_fn(root, *args, **kwargs)

        return forward, [self.root]

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with functions_as_calls_in_fx(self), torch_markers_recorded():
            return super().trace(root, concrete_args)

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


def _graph_inputs(bound: inspect.BoundArguments) -> dict[str, Any]:
    """The model inputs that hold tensors, by the name their placeholder gets: a parameter's own
    name, and for ``**kwargs`` each keyword's name (``*args`` entries: ``args_0``, ``args_1``...)."""
    inputs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            inputs.update({k: v for k, v in value.items() if has_tensor(v)})
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            inputs.update({f"{name}_{i}": v for i, v in enumerate(value) if has_tensor(v)})
        elif has_tensor(value):
            inputs[name] = value
    return inputs


def _root_call(bound: inspect.BoundArguments, graph_inputs: set[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """forward's call during tracing: graph inputs as _GraphInput, the rest as passed. Parameters
    not passed are left out, so forward sees its own defaults (a tensor default stays a constant)."""
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = tuple(_GraphInput(f"{name}_{i}") if f"{name}_{i}" in graph_inputs else v
                                    for i, v in enumerate(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            arguments[name] = {k: _GraphInput(k) if k in graph_inputs else v for k, v in value.items()}
        else:
            arguments[name] = _GraphInput(name) if name in graph_inputs else value
    call = inspect.BoundArguments(bound.signature, arguments)  # type: ignore[arg-type]
    return call.args, call.kwargs


class _Default:
    """"Not passed: forward used its own default" (one object, in every process: a binding travels to ranks)."""

    def __reduce__(self) -> str:
        return "_DEFAULT"


_DEFAULT = _Default()


def _fixed(bound: inspect.BoundArguments, graph_inputs: set[str]) -> dict[str, Any]:
    """What the trace fixed: every argument passed that is not a graph input ({'kwargs': {...}}
    for ``**kwargs`` entries), and the parameters left to their default (``_DEFAULT``)."""
    fixed: dict[str, Any] = {}
    for name, param in bound.signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            values = bound.arguments.get(name, ())
            fixed[name] = {i: v for i, v in enumerate(values) if f"{name}_{i}" not in graph_inputs}
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            values = bound.arguments.get(name, {})
            fixed[name] = {k: v for k, v in values.items() if k not in graph_inputs}
        elif name not in bound.arguments:
            fixed[name] = _DEFAULT
        elif name not in graph_inputs:
            fixed[name] = bound.arguments[name]
    return fixed


def trace_fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], split_spec: dict[str, SplitPoint]) -> Traced:
    bound = bind_signature(model, *unwrap_replicated((args, kwargs)))
    inputs = _graph_inputs(bound)
    fixed = _fixed(bound, set(inputs))
    tracer = _SplitTracer(split_spec, _root_call(bound, set(inputs)))
    _active_fx_tracer.append(tracer)
    try:
        with state_kept(model, drop=fx.Proxy) as assigned:
            graph = tracer.trace(model)
    except Exception as err:  # fx raises many kinds; the message names the construct
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__}: {type(err).__name__}: {err}{_where(err)}\n"
            "Fix: remove data-dependent control flow from forward, or try tracer='export' "
            "(torch.export handles more Python, and reports what it cannot)."
        ) from None
    finally:
        _active_fx_tracer.pop()
    if assigned:  # fx ran forward on Proxies and recorded none of these assignments
        raise state_assigned_error("torch.fx", model, assigned, "tracer='export' records updates in place "
                                   "(`self.buf += x` under no_grad)")
    unused_spec(split_spec, tracer.called, "fx")
    unknown = _unknown_output_classes(graph)
    if unknown:  # fx builds a dataclass in the graph; pytree, which splits and compares, cannot open it
        raise unknown_output_error(model, unknown)
    attrs = {n.target: resolve(model, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    return Traced(graph, attrs, names, FxBinding(names, fixed, frozenset(inputs)), "fx")


@dataclass(frozen=True)
class FxBinding:
    """Binds a call's arguments to an fx graph's inputs, refusing non-tensor arguments other than traced."""

    names: tuple[str, ...]
    fixed: dict[str, Any]  # what the trace fixed (see _fixed)
    graph_inputs: frozenset[str]

    def for_call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FxBinding:
        """This binding with what the trace fixed read off ``(args, kwargs)``: the objects of this call,
        equal to the traced ones (a copy that arrived pickled, an option object without ``==``)."""
        return dataclasses.replace(self, fixed=_fixed(bind_signature(model, *unwrap_replicated((args, kwargs))),
                                                      set(self.graph_inputs)))

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        now_bound = bind_signature(model, args, kwargs)
        now = _graph_inputs(now_bound)
        _check_fixed(now_bound, self.fixed, set(self.graph_inputs), now)
        return {name: now[name] for name in self.names}


def _unknown_output_classes(graph: fx.Graph) -> list[str]:
    """Classes fx constructs in the graph's output (it does so for dataclasses) that pytree does not know."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    found: set[str] = set()

    def visit(node: fx.Node) -> None:
        if node.op == "call_function" and isinstance(node.target, type) and node.target not in pytree.SUPPORTED_NODES \
                and dataclasses.is_dataclass(node.target):
            found.add(node.target.__qualname__)

    fx.node.map_arg(output.args, visit)
    return sorted(found)


def _where(err: BaseException) -> str:
    """`` (at file:line in function: code)``: the innermost frame of the model's own code, not torch's."""
    torch_dir, ours = os.path.dirname(torch.__file__), os.path.dirname(__file__)
    frames = [frame for frame in traceback.extract_tb(err.__traceback__)
              if not frame.filename.startswith((torch_dir, ours, "<"))]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()})"


def _check_fixed(bound: inspect.BoundArguments, fixed: dict[str, Any], graph_inputs: set[str],
                 now: dict[str, Any]) -> None:
    """Non-tensor arguments (and parameters left to their defaults) are fixed when the model is
    traced: a call with other values would silently run the traced ones."""
    problems = []
    for name, traced in fixed.items():
        param = bound.signature.parameters[name]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            positional = param.kind is param.VAR_POSITIONAL
            value = bound.arguments.get(name, () if positional else {})
            keys = range(len(value)) if positional else value.keys()
            entries = {k: value[k] for k in keys if (f"{name}_{k}" if positional else k) not in now}
            for k in set(entries) | set(traced):
                label = f"{name}[{k}]" if positional else str(k)
                problems += _differs(label, entries.get(k, _DEFAULT), traced.get(k, _DEFAULT))
            continue
        problems += _differs(name, bound.arguments.get(name, _DEFAULT), traced)
    missing = [name for name in graph_inputs if name not in now]
    problems += [f"{name} is missing; it was a tensor input when traced" for name in missing]
    if problems:
        raise InputError("inputs differ from the ones the model was split with (non-tensor arguments and "
                         "defaults are fixed at split time): " + "; ".join(problems)
                         + ". Fix: split again with these inputs.")


def _differs(name: str, value: Any, traced: Any) -> list[str]:
    if value is traced:  # both _DEFAULT (not passed either time: forward's own default), or the same object
        return []
    if value is _DEFAULT:
        return [f"{name} is not passed now, but was {traced!r} when traced"]
    if traced is _DEFAULT:
        what = "a tensor" if has_tensor(value) else repr(value)
        return [f"{name} is {what} now, but was left to its default when traced"]
    if has_tensor(value):
        return [f"{name} is a tensor now, but was {traced!r} when traced"]
    try:
        same = bool(value == traced)
    except Exception:
        same = False
    return [] if same else [f"{name}={value!r}, traced with {name}={traced!r}"]
