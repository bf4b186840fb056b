"""Hypothesis strategies that generate random models for pipeline checks.

::

    from hypothesis import given
    from pipecheck import strategies as pst

    @given(pst.models(max_layers=4))
    def test_split_matches_eager(spec):
        model, (args, kwargs) = pst.build(spec), pst.make_inputs(spec)
        ...

A failing example shrinks to a small :class:`ModelSpec`; ``pst.to_source(spec)``
prints a script that rebuilds it with nothing but torch.
"""

from pipecheck.strategies._internal.builder import build, make_inputs, to_source
from pipecheck.strategies._internal.description import (
    FEATURES,
    InputSpec,
    LayerSpec,
    ModelSpec,
    OutputSpec,
    features,
)
from pipecheck.strategies._internal.models import models

__all__ = [
    "FEATURES",
    "InputSpec",
    "LayerSpec",
    "ModelSpec",
    "OutputSpec",
    "build",
    "features",
    "make_inputs",
    "models",
    "to_source",
]
