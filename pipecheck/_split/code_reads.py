"""What a model's forward reads beyond its parameters: a reused split's key holds it.

    reads = code_reads(model)   # hashable; equal for two models only if their code reads the same things

A trace bakes into its graph what forward reads: the helper methods it calls and the globals they
read. Starting at each module class's ``forward``, the walk follows the names the code reads (nested
functions and closures too): a method of one of the model's classes by that name (``self.act``), a
global of the function's module, an attribute of a module it reads (``config.SCALE``). A number,
string, bool, None, dtype or device (or a tuple of them) is kept by value; anything else by identity
(a function, a class, a dict: one replaced is another key; a dict changed in place is not seen, which
is what the check's re-trace on a failure is for). The code of torch, pipecheck (but its zoo) and
Python's standard library is not walked: only a user's, or a model library's (transformers).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch
import torch.nn as nn

_SCALARS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_NOT_WALKED = frozenset({"torch", "pipecheck", "builtins", *sys.stdlib_module_names})
_MISSING = object()  # not a scalar: an attribute a module does not have is not read from it
_LIMIT = 5000  # functions walked at most (a model library's whole call graph is far smaller)


class _Same:
    """An object compared by identity, held alive by the key (so its id is never reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def code_reads(model: nn.Module) -> tuple[Any, ...]:
    """Every method, global and module attribute the model's forwards read, as a hashable tuple."""
    classes = list(dict.fromkeys(type(m) for m in model.modules()))
    methods: dict[str, list[types.FunctionType]] = {}
    for cls in classes:
        for klass in cls.__mro__:
            if _walked(klass):
                for name, value in vars(klass).items():
                    function = _function_of(value)
                    if function is not None and function not in methods.setdefault(name, []):
                        methods[name].append(function)
    reads: list[tuple[Any, ...]] = []
    seen: set[int] = set()
    # a forward wrapped by its decorator (functools.wraps; pipecheck's own, which leaves a generation cache out
    # of the outputs) is walked from the function it wraps
    todo = [inspect.unwrap(f) for cls in classes if (f := _function_of(getattr(cls, "forward", None))) is not None]
    while todo and len(seen) < _LIMIT:
        function = todo.pop()
        if id(function) in seen or not _walked(function):
            continue
        seen.add(id(function))
        names = _names(function.__code__)
        for name in names:
            if name in methods:
                reads.append(("method", name, *map(_Same, methods[name])))
                todo.extend(methods[name])
            if name not in function.__globals__:
                continue
            value = function.__globals__[name]
            reads.append((function.__module__, name, _kept(value)))
            if isinstance(value, types.ModuleType) and _walked_module(value.__name__):  # config.SCALE: what it names
                for attribute in names:  # names the module lacks are another object's attributes (self.b)
                    named = getattr(value, attribute, _MISSING)
                    if attribute != name and isinstance(named, (*_SCALARS, types.FunctionType)):
                        reads.append((value.__name__, attribute, _kept(named)))
                        todo.extend(_function_list(named))
            todo.extend(_function_list(value))
        for i, cell in enumerate(function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            reads.append(("closure", function.__qualname__, i, _kept(value)))
            todo.extend(_function_list(value))
    return tuple(reads)


def _names(code: types.CodeType) -> list[str]:
    """The global and attribute names ``code`` reads, nested functions' too, in order, once each."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return list(dict.fromkeys(names))


def _kept(value: Any) -> Any:
    if isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value)):
        return value
    return _Same(value)


def _function_of(value: Any) -> types.FunctionType | None:
    """The Python function behind a class attribute (a method, staticmethod, classmethod or property)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


def _function_list(value: Any) -> list[types.FunctionType]:
    return [value] if isinstance(value, types.FunctionType) else []


def _walked(obj: Any) -> bool:
    return _walked_module(getattr(obj, "__module__", None) or "")


def _walked_module(name: str) -> bool:
    return name.split(".")[0] not in _NOT_WALKED or name.startswith("pipecheck.fixtures")
