"""Picklable factories of odd models, importable by spawned ranks (tests/ is on their sys.path)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn as nn


def numpy_initialised_model() -> nn.Module:
    """Weights drawn from numpy's global RNG, which pipecheck does not seed: other weights each call."""
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 8))
    model.add_module("b", nn.Linear(8, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.from_numpy(np.random.randn(*parameter.shape)))
    return model


def urandom_initialised_model() -> nn.Module:
    """Weights from a generator seeded by os.urandom: no seed reproduces them."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 8))
    model.add_module("b", nn.Linear(8, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model
