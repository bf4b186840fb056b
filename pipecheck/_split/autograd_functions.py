"""Custom ``torch.autograd.Function``s keep their own backward in every split.

    with functions_as_calls_in_fx(tracer):     # fx: Fn.apply(proxy) is ONE call node
        graph = tracer.trace(model)
    with functions_in_export() as functions:   # export: kept as one call where torch can, else refused
        exported = torch.export.export(...)
    gm = functions_as_calls(exported.module())
    functions.refuse_lost(model, gm.graph)     # TraceError naming any Function whose backward is lost

Both tracers, left alone, record a Function's *forward* ops: autograd then
differentiates those and the Function's backward never runs (a gradient
reversal flips sign, a straight-through estimator gives zero), which a check
would report as a mismatch on a correct model. fx is told to record
``Fn.apply`` as a call; non-strict export keeps it through torch's
experimental ``allow_in_pre_dispatch_graph`` (a ``flat_apply`` node that
re-imports the class by name), which is turned into the same call. A Function
torch cannot keep (a class that is not a module-level, importable one; a torch
without that wrapper) is refused at split time, never compared.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.traced import resolve
from pipecheck.errors import TraceError

# The classmethod itself: a Python ``classmethod`` up to torch 2.13, the C ``classmethod_descriptor`` of
# ``torch._C._FunctionBase`` from 2.14 on. Both bind to a class with ``__get__(None, cls)``; only the
# former has ``__func__``.
_FUNCTION_APPLY = torch.autograd.function.Function.__dict__["apply"]
_FUNCTION_CALLS: dict[type, Callable[..., Any]] = {}


def function_call(cls: type) -> Callable[..., Any]:
    """The graph's call target for one autograd.Function class: ``cls.apply`` under a name of its own.

    Not ``cls.apply`` itself: that bound method reports ``__module__ == 'torch.autograd.function'``,
    and fx's code generation writes torch objects by qualified name
    (``torch.autograd.function.Function.apply``), which is the base class's apply.
    """
    if cls not in _FUNCTION_CALLS:
        def apply(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        apply.__module__ = __name__
        apply.autograd_function = cls  # type: ignore[attr-defined]
        _FUNCTION_CALLS[cls] = apply
    return _FUNCTION_CALLS[cls]


def _original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """torch's own ``Function.apply`` of ``cls``, as a plain function of the class."""
    return _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


_original_apply.__name__ = "apply"  # torch's allow_in_pre_dispatch_graph wraps only a function of that name


class functions_as_calls_in_fx:  # noqa: N801 - a context manager read as a phrase
    """While fx traces, ``Fn.apply(proxy, ...)`` of any ``torch.autograd.Function`` records ONE
    ``call_function`` node instead of running ``Fn.forward`` on proxies."""

    def __init__(self, tracer: fx.Tracer) -> None:
        self.tracer = tracer

    def __enter__(self) -> None:
        tracer = self.tracer

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
            return _original_apply(cls, *args, **kwargs)

        torch.autograd.function.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.function.Function.apply = _FUNCTION_APPLY  # type: ignore[method-assign]


def _importable(cls: type) -> bool:
    """torch's flat_apply call finds the Function again by ``module.qualname`` when it runs."""
    try:
        module = importlib.import_module(cls.__module__)
    except Exception:
        return False
    return "." not in cls.__qualname__ and getattr(module, cls.__qualname__, None) is cls


class functions_in_export:  # noqa: N801 - a context manager read as a phrase
    """While torch.export traces (non-strict): record every autograd.Function applied, and keep
    each importable one as ONE call in the graph, so its backward runs when a stage runs.

    ``self.seen`` lists the classes applied, ``self.kept`` those kept as a call. The user's
    classes are never touched: the base class's ``apply`` is swapped for the duration.
    """

    def __init__(self) -> None:
        self.seen: list[type] = []
        self.kept: list[type] = []

    def __enter__(self) -> functions_in_export:
        keep = _export_keeper()

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if cls.__module__ == "torch._library.autograd":  # a torch.library.custom_op's own autograd:
                return _original_apply(cls, *args, **kwargs)  # the op stays one node, nothing is lost
            if cls not in self.seen:
                self.seen.append(cls)
            if keep is not None and _importable(cls) and torch.compiler.is_exporting():
                if cls not in self.kept:
                    self.kept.append(cls)
                return keep(cls, *args, **kwargs)
            return _original_apply(cls, *args, **kwargs)

        torch.autograd.function.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.function.Function.apply = _FUNCTION_APPLY  # type: ignore[method-assign]

    def refuse_lost(self, model: nn.Module, graph: fx.Graph) -> None:
        """TraceError naming every Function whose backward the graph would not run (call this after
        :func:`functions_as_calls`: a kept Function is then a call of ``function_call(cls)``)."""
        kept = {getattr(node.target, "autograd_function", None) for node in graph.nodes if node.op == "call_function"}
        lost = [cls for cls in self.seen if cls not in kept]
        if lost:
            names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in lost)
            why, fix = (
                ("pipecheck keeps a Function under export only when it is a top-level class of an importable "
                 "module", "define the Function at module level, ")
                if export_keeps_functions() else
                (f"torch {torch.__version__} has no way to keep one as a call (torch._export.wrappers."
                 "allow_in_pre_dispatch_graph and torch.export.custom_ops' by-name call, which pipecheck "
                 "uses, came with torch 2.9)", "use a supported torch (>= 2.10), "))
            raise TraceError(
                f"torch.export cannot keep the backward of the custom autograd.Function {names} in "
                f"{type(model).__name__}: it records the Function's forward ops, so a pipeline built from it "
                f"would differentiate those instead of the Function's backward; {why}. Fix: use "
                f"tracer='fx' (it keeps Fn.apply as one call), {fix}or make it a torch.library.custom_op "
                "with register_autograd."
            )


def _export_keeper() -> Callable[..., Any] | None:
    """torch's wrapper that records ``Fn.apply`` as one call under export, or None where this torch has
    no such wrapper or no by-name call to turn it back into a Function (then refuse_lost refuses)."""
    try:
        from torch._export.wrappers import allow_in_pre_dispatch_graph
        from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch  # noqa: F401
    except ImportError:
        return None
    return allow_in_pre_dispatch_graph(_original_apply)


def export_keeps_functions() -> bool:
    """Whether this torch lets export keep a custom autograd.Function as one call (a feature probe)."""
    return _export_keeper() is not None


def functions_as_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """Each ``flat_apply`` node that export recorded for a kept Function becomes a plain call of
    ``function_call(cls)`` (as fx records it), and its two constant ``get_attr`` operands (TreeSpecs)
    go: stage modules then hold only tensors, and torch's pipeline() accepts the graph (its
    ``move_param_to_callee`` asserts every get_attr is a tensor)."""
    try:
        from torch._higher_order_ops.flat_apply import flat_apply
        from torch.export.custom_ops import (
            _call_custom_autograd_function_in_pre_dispatch as by_name,
        )
    except Exception:
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not flat_apply:
            continue
        func_node, spec_node, *flat = node.args
        if not (isinstance(func_node, fx.Node) and func_node.op == "get_attr"
                and isinstance(spec_node, fx.Node) and spec_node.op == "get_attr"):
            continue
        func = pytree._retrieve_constant(resolve(gm, str(func_node.target)))  # type: ignore[attr-defined]
        if getattr(func, "func", None) is not by_name:
            continue
        (cls_name, *args), kwargs = pytree.tree_unflatten(flat, resolve(gm, str(spec_node.target)))
        module_name, _, class_name = cls_name.rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        with graph.inserting_before(node):
            call = graph.call_function(function_call(cls), tuple(args), dict(kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for const in (func_node, spec_node):
            if not const.users:
                graph.erase_node(const)
                if not any(n.op == "get_attr" and n.target == const.target for n in graph.nodes):
                    delattr(gm, str(const.target))
    gm.recompile()
    return gm
