"""The Job every runner receives: its split made once, and a copy with other settings splits again."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import pipecheck as pc


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_a_job_splits_once_and_a_replaced_job_splits_as_it_asks() -> None:
    job = pc.Job(model=_model, args=(torch.randn(8, 4),), split_spec={"2": pc.SplitPoint.BEGINNING})
    first = job.structure()
    assert first.num_stages == 2 and job.structure() is first and job.pipe is None  # cut once, privately
    recut = dataclasses.replace(job, split_spec={"2": pc.SplitPoint.BEGINNING, "4": pc.SplitPoint.BEGINNING})
    assert recut.structure().num_stages == 3
    assert job.split() is not first and job.split().num_stages == 2  # a private copy to run
    assert list(job.bound) == ["input"]  # the inputs bound once, by forward's parameter names
