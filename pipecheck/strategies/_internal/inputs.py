"""The ``inputs()`` strategy: ``(args, kwargs)`` for a :class:`ModelSpec`.

::

    @given(st.data())
    def test_any_inputs(data):
        spec = data.draw(pst.models())
        args, kwargs = data.draw(pst.inputs(spec, dtype=torch.bfloat16))
        pst.build(spec)(*args, **kwargs)
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from pipecheck.strategies._internal.builder import make_inputs
from pipecheck.strategies._internal.cuts import _raise_if_any
from pipecheck.strategies._internal.description import ModelSpec

Inputs = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]

_MAX_OFFSET = 2**32 - 1


def inputs(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> st.SearchStrategy[Inputs]:
    """``(args, kwargs)`` for ``build(spec)``, shaped as ``make_inputs(spec, dtype)``.

    Float inputs (``x`` and kwargs) are standard normal, drawn in float32 and
    cast to ``dtype``; token ids are int64 in ``[0, vocabulary)``; optional
    kwargs the spec does not pass are left out, as in ``make_inputs``. The
    values come from a seed drawn per example.

    Shrinks towards ``make_inputs(spec, dtype)`` exactly (seed offset 0).
    """
    problems = []
    if not isinstance(spec, ModelSpec):
        problems.append(f"spec={spec!r} must be a ModelSpec, e.g. one drawn from models()")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        problems.append(f"dtype={dtype!r} must be a floating torch.dtype, e.g. dtype=torch.float64")
    _raise_if_any("inputs", problems)
    return _inputs(spec, dtype=dtype)


def _draw_inputs(draw: st.DrawFn, spec: ModelSpec, *, dtype: torch.dtype = torch.float32) -> Inputs:
    offset = draw(st.integers(0, _MAX_OFFSET))
    return make_inputs(spec, dtype, seed=(spec.seed + 1 + offset) % 2**63)


_draw_inputs.__name__ = _draw_inputs.__qualname__ = "inputs"  # repr: the call
_inputs = st.composite(_draw_inputs)
