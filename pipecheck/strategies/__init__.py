"""Hypothesis strategies that generate random models and pipeline checks.

::

    from hypothesis import given
    from pipecheck import strategies as pst

    @given(pst.pipeline_cases(dtypes=(torch.float32, torch.float64)))
    def test_pipeline_matches_eager(case):
        case.check()          # pc.assert_equivalent(...), with the repro in any failure

In bfloat16 some rows of a case may not see an error of 10% (the eager run is itself far from
float64 there): ``case.check()`` then raises :class:`pipecheck.PowerError`, which says so.

``models()`` draws a :class:`ModelSpec`, ``cut_points(spec)`` its split_specs,
``inputs(spec)`` its inputs, ``pipeline_cases()`` a whole :class:`PipelineCase`.
Random layers (``RANDOM_FEATURES``: dropout in its forms, stochastic depth, a
checkpointed block with dropout) are drawn by ``pipeline_cases()`` when every
runner follows pipecheck's randomness contract, and by ``models()`` when named.
A failing example shrinks to a small case; ``case.repro()`` (appended to the
error by ``case.check()``) is a script that rebuilds the model with nothing but
torch and makes the exact failing ``pc.assert_equivalent`` call.
"""

from pipecheck.strategies._internal.builder import build, make_inputs, to_source
from pipecheck.strategies._internal.cases import PipelineCase, pipeline_cases
from pipecheck.strategies._internal.cuts import CROSSINGS, CUT_KINDS, cut_points
from pipecheck.strategies._internal.description import (
    FEATURES,
    RANDOM_FEATURES,
    InputSpec,
    LayerSpec,
    ModelSpec,
    OutputSpec,
    features,
)
from pipecheck.strategies._internal.inputs import inputs
from pipecheck.strategies._internal.models import models
from pipecheck.strategies._internal.training import LOSS_REDUCTIONS, OPTIMIZERS

__all__ = [
    "CROSSINGS",
    "CUT_KINDS",
    "FEATURES",
    "InputSpec",
    "LOSS_REDUCTIONS",
    "LayerSpec",
    "ModelSpec",
    "OPTIMIZERS",
    "OutputSpec",
    "PipelineCase",
    "RANDOM_FEATURES",
    "build",
    "cut_points",
    "features",
    "inputs",
    "make_inputs",
    "models",
    "pipeline_cases",
    "to_source",
]
