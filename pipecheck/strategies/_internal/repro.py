"""Python source that reproduces a generated pipeline check, stand-alone.

    print(repro.source(spec, {"split_spec": {"l1": SplitPoint.BEGINNING}, "runner": "reference"}))

The script is ``to_source(spec)`` (the model and its inputs, importing only
torch) with ``import pipecheck as pc`` and a test function making the exact
``pc.assert_equivalent`` call; run as ``__main__`` it calls that test.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from pipecheck._check.numerics import Tolerance
from pipecheck._split.markers import SplitPoint
from pipecheck.strategies._internal.builder import script
from pipecheck.strategies._internal.description import ModelSpec

BANNER = ("Reproduce this failure with the script below (pipecheck.strategies): paste it into "
          "a test file, or run it with python.")

# Driver-side objects that cannot be written as source; the runner makes its own.
_LEFT_OUT = {"world": "the runner makes its own"}  # live objects that have no source form


def source(spec: ModelSpec, arguments: Mapping[str, Any]) -> str:
    """The script checking ``build(spec)`` on ``make_inputs(spec)`` with ``arguments``.

    ``arguments`` are ``pc.assert_equivalent``'s keyword arguments. Callables
    (a runner, a loss) are imported by name when they can be; anything else
    that has no source form is written as ``NotImplemented`` with a comment.
    """
    imports: dict[str, None] = {"import pipecheck as pc": None}
    lines = ["def test_pipeline_case() -> None:",
             '    """The pipeline check pipecheck.strategies generated."""',
             "    args, kwargs = make_inputs()",
             *(f"    kwargs[{spec_input.name!r}] = pc.Replicated(kwargs[{spec_input.name!r}])  # no batch dimension"
               for spec_input in spec.inputs if spec_input.role == "replicated"),
             "    pc.assert_equivalent(",
             "        make_model,",
             "        args,",
             "        kwargs,"]
    for name, value in arguments.items():
        if name in _LEFT_OUT:
            if value is not None:
                lines.append(f"        # {name}=... left out: {_LEFT_OUT[name]}")
            continue
        text, comment = _source_of(value, imports)
        lines.append(f"        {name}={text},{f'  # {comment}' if comment else ''}")
    lines += ["    )"]
    main = 'if __name__ == "__main__":\n    test_pipeline_case()\n'
    return script(spec, list(imports), ["\n".join(lines) + "\n", main])


def _source_of(value: Any, imports: dict[str, None]) -> tuple[str, str]:
    """(Python source evaluating to ``value``, a comment when it could not be written)."""
    if isinstance(value, torch.dtype):
        return str(value), ""
    if isinstance(value, SplitPoint):
        return f"pc.SplitPoint.{value.name}", ""
    if isinstance(value, Tolerance):
        return f"pc.Tolerance(rtol={value.rtol!r}, atol={value.atol!r})", ""
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            text, comment = _source_of(item, imports)
            if comment:
                return "NotImplemented", f"{value!r} has no source form: pass it here"
            items.append(f"{key!r}: {text}")
        return "{" + ", ".join(items) + "}", ""
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value), ""
    name = _importable(value)
    if name is not None:
        module, qualname = name
        imports[f"from {module} import {qualname.split('.')[0]}"] = None
        return qualname, ""
    return "NotImplemented", f"{value!r} is not importable by name: pass it here"


def _importable(value: Any) -> tuple[str, str] | None:
    """(module, qualified name) that import back to ``value`` itself, or None."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if module == "__main__" or "<" in qualname:  # a script's own name, a lambda, a local
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (module, qualname) if found is value else None
