"""Split policies: choose stage cuts automatically from the traced graph.

    pipe = pc.split(model, (x,), policy=pc.policies.balanced_params(4))

A policy is any callable ``policy(units) -> list[int]``: ``units`` are the
traced graph's compute nodes in execution order, each with the parameters it
uses first; the result lists the unit indices where a new stage begins
(strictly increasing, each in ``1..len(units)-1``). With a policy, any
``pipe_split()`` markers in forward are ignored.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pipecheck.errors import SplitError


@dataclass(frozen=True)
class Unit:
    """One compute node of the traced graph, with the parameters first used there."""

    name: str
    params: int
    param_bytes: int


class Policy(Protocol):
    def __call__(self, units: Sequence[Unit], /) -> list[int]: ...


def _positive_stage_count(policy: object, n_stages: object) -> None:
    try:
        count = operator.index(n_stages)  # type: ignore[arg-type]
    except TypeError:
        count = 0
    if isinstance(n_stages, bool) or count < 1:
        raise SplitError(f"{type(policy).__name__}(n_stages={n_stages!r}): the number of stages must be a positive "
                         f"int. Fix: e.g. {type(policy).__name__}(2).")


def _check_stage_count(n_stages: int, units: Sequence[Unit]) -> None:
    if n_stages > len(units):
        raise SplitError(
            f"more stages requested than the graph allows (stages: {n_stages}, compute nodes: {len(units)}). "
            f"Fix: ask for at most {len(units)} stages."
        )


def _balanced_cuts(weights: Sequence[int], n_stages: int) -> list[int]:
    """Cut so each stage's weight is near total/n; ties go to the later boundary."""
    total = sum(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts: list[int] = []
    for k in range(1, n_stages):
        lo = (cuts[-1] + 1) if cuts else 1
        hi = len(weights) - (n_stages - k)
        target = total * k / n_stages
        best = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), -i))
        cuts.append(best)
    return cuts


@dataclass(frozen=True)
class balanced_params:  # noqa: N801 - reads as a function at the call site
    """Cut into ``n_stages`` stages holding about the same number of parameter elements."""

    n_stages: int

    def __post_init__(self) -> None:
        _positive_stage_count(self, self.n_stages)

    def __call__(self, units: Sequence[Unit], /) -> list[int]:
        _check_stage_count(self.n_stages, units)
        weights = [u.params for u in units]
        if sum(weights) == 0:
            weights = [1] * len(units)
        return _balanced_cuts(weights, self.n_stages)


@dataclass(frozen=True)
class balanced_nodes:  # noqa: N801
    """Cut into ``n_stages`` stages with about the same number of compute nodes."""

    n_stages: int

    def __post_init__(self) -> None:
        _positive_stage_count(self, self.n_stages)

    def __call__(self, units: Sequence[Unit], /) -> list[int]:
        _check_stage_count(self.n_stages, units)
        return _balanced_cuts([1] * len(units), self.n_stages)


@dataclass(frozen=True)
class param_bytes_buckets:  # noqa: N801
    """Dynamo DDPOptimizer's rule: walk the graph backwards, start a new stage once a
    stage's parameter bytes would exceed ``cap_bytes``. The stage count follows."""

    cap_bytes: int

    def __call__(self, units: Sequence[Unit], /) -> list[int]:
        if self.cap_bytes <= 0:
            raise SplitError(f"param_bytes_buckets(cap_bytes={self.cap_bytes}) needs a positive cap.")
        cuts: list[int] = []
        bucket = 0
        for i in range(len(units) - 1, 0, -1):
            bucket += units[i].param_bytes
            if bucket >= self.cap_bytes and units[i].param_bytes:
                cuts.append(i)
                bucket = 0
        return sorted(cuts)


def validate_cuts(cuts: Sequence[int], n_units: int, policy: object) -> list[int]:
    cuts = list(cuts)
    bad = [c for c in cuts if not isinstance(c, int) or not 0 < c < n_units]
    if bad or cuts != sorted(set(cuts)):
        raise SplitError(
            f"policy {policy!r} returned cuts {cuts}; each must be an int in 1..{n_units - 1}, "
            "strictly increasing. Fix the policy."
        )
    return cuts
