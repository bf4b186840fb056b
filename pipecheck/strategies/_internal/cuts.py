"""The ``cut_points()`` strategy: valid split_specs for a :class:`ModelSpec`.

::

    @given(st.data())
    def test_any_cut(data):
        spec = data.draw(pst.models())
        split_spec = data.draw(pst.cut_points(spec, max_stages=3))  # {"l2": SplitPoint.BEGINNING}

A cut goes before a layer (``{f"l{k}": SplitPoint.BEGINNING}``), and only before
a layer that computes something (``spec.computes(k)``), after the first such
layer: so every stage holds at least one operation and no splitter sees an
empty stage. Most cuts are drawn where pipelines go wrong (see ``CUT_KINDS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hypothesis import strategies as st

from pipecheck._split.markers import SplitPoint
from pipecheck.errors import InputError
from pipecheck.strategies._internal.description import ModelSpec, X

CUT_KINDS = ("first", "last", "output", "tied", "skip", "input")
"""Where biased cuts go, besides anywhere: right after the inputs (the first
computing layer alone in stage 0), right before the last layer, around a layer
whose value is an output, between a tied weight's owner and its user, inside a
skip connection's span (two such cuts make it cross more than one stage), and
before a layer reading a model input (a kwarg or token ids)."""

CROSSINGS = (
    "tied_across_stages", "skip_across_stages", "skip_over_stage", "input_to_later_stage",
    "kwarg_to_later_stage", "output_from_early_stage", "single_layer_stage",
)
"""What a split can exercise, as :func:`crossings` names it."""

SplitSpec = dict[str, SplitPoint]


@dataclass(frozen=True)
class CutPlan:
    """Where cuts may go in one model, and the groups of interesting places per kind.

    ``positions`` are the layers a cut may precede. ``groups`` pairs each kind of
    ``CUT_KINDS`` that occurs in the model with its groups of positions (e.g. one
    group per skip connection: the positions inside its span), each sorted.
    """

    positions: tuple[int, ...]
    groups: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]

    @property
    def max_stages(self) -> int:
        return len(self.positions) + 1


def cut_plan(spec: ModelSpec) -> CutPlan:
    """The places ``spec`` may be cut, grouped by what a cut there exercises."""
    computing = [k for k in range(len(spec.layers)) if spec.computes(k)]
    positions = tuple(computing[1:])
    allowed = set(positions)

    def within(low: int, high: int) -> tuple[int, ...]:
        """Positions p with low < p <= high: a cut there separates value low from layer high."""
        return tuple(p for p in positions if low < p <= high)

    kinds: dict[str, list[tuple[int, ...]]] = {kind: [] for kind in CUT_KINDS}
    if positions:
        kinds["first"].append(positions[:1])
        kinds["last"].append(positions[-1:])
    for value in spec.outputs.values:  # the output's layer starts a stage, or ends one early
        after = [p for p in positions if p > value][:1]
        kinds["output"].append(tuple(sorted({value} & allowed | set(after))))
    for index, layer in enumerate(spec.layers):
        if layer.kind == "tied" and layer.tied_to is not None:
            kinds["tied"].append(within(layer.tied_to, index))
        for source in layer.sources:
            if source < index - 1:  # read from further back than the previous layer
                kinds["skip"].append(within(source, index))
        if layer.input_name and spec.computes(index):
            kinds["input"].append(within(X, index))
    groups = tuple(
        (kind, tuple(sorted({group for group in found if group})))
        for kind, found in kinds.items() if any(found)
    )
    return CutPlan(positions, groups)


def cut_points(spec: ModelSpec, *, min_stages: int = 2,
               max_stages: int = 4) -> st.SearchStrategy[SplitSpec]:
    """Valid split_specs ``{f"l{k}": SplitPoint.BEGINNING, ...}`` cutting ``spec`` into stages.

    The number of stages lies in ``[min_stages, max_stages]``, capped by the
    layers that compute (a model of three layers has at most three stages).
    Each cut is drawn anywhere, or (more often) at a place of ``CUT_KINDS``:
    right after the inputs, right before the outputs, between the two uses of
    a tied weight, inside a skip span, before a layer reading a kwarg.

    Shrinks towards fewer stages (``min_stages``) and earlier cuts: each cut to
    "anywhere" and then to the first free position, so a two-stage split
    shrinks to ``{"l1": SplitPoint.BEGINNING}`` when layer 1 computes.
    """
    problems = _stage_problems(min_stages, max_stages)
    if not isinstance(spec, ModelSpec):
        problems.insert(0, f"spec={spec!r} must be a ModelSpec, e.g. one drawn from models()")
    elif not problems and cut_plan(spec).max_stages < min_stages:
        problems.append(
            f"min_stages={min_stages} but spec has only {cut_plan(spec).max_stages} layers that "
            "compute, so at most that many stages; pass a smaller min_stages or a bigger model")
    _raise_if_any("cut_points", problems)
    return _cut_points(spec, min_stages=min_stages, max_stages=max_stages)


def _draw_cut_points(draw: st.DrawFn, spec: ModelSpec, *, min_stages: int = 2,
                     max_stages: int = 4) -> SplitSpec:
    plan = cut_plan(spec)
    n_stages = draw(st.integers(min_stages, min(max_stages, plan.max_stages)))
    return draw_cuts(draw, plan, n_stages)


_draw_cut_points.__name__ = _draw_cut_points.__qualname__ = "cut_points"  # repr: the call
_cut_points = st.composite(_draw_cut_points)


def draw_cuts(draw: st.DrawFn, plan: CutPlan, n_stages: int) -> SplitSpec:
    """``n_stages - 1`` distinct cuts from ``plan``, as a split_spec in layer order.

    Each cut draws a kind (0: anywhere), then a group of that kind, then a
    position in it that is still free; every index shrinks to 0, the earliest.
    """
    chosen: list[int] = []
    for _ in range(n_stages - 1):
        free = [p for p in plan.positions if p not in chosen]
        options = free
        kind = draw(st.integers(0, len(plan.groups)))
        if kind:
            groups = plan.groups[kind - 1][1]
            group = groups[draw(st.integers(0, len(groups) - 1))]
            options = [p for p in group if p not in chosen] or free
        chosen.append(options[draw(st.integers(0, len(options) - 1))])
    return {f"l{k}": SplitPoint.BEGINNING for k in sorted(chosen)}


def stage_of_layers(spec: ModelSpec, split_spec: Mapping[str, object]) -> list[int]:
    """The stage of every layer under ``split_spec`` (cuts before layers, as cut_points draws)."""
    cuts = {int(name[1:]) for name in split_spec}
    stages, stage = [], 0
    for index in range(len(spec.layers)):
        stage += index in cuts
        stages.append(stage)
    return stages


def crossings(spec: ModelSpec, split_spec: Mapping[str, object]) -> set[str]:
    """Names (from ``CROSSINGS``) of what cutting ``spec`` at ``split_spec`` exercises."""
    stage = stage_of_layers(spec, split_spec)
    n_stages = len(split_spec) + 1
    found: set[str] = set()

    def stage_of(value: int) -> int:
        return 0 if value == X else stage[value]

    for index, layer in enumerate(spec.layers):
        if layer.kind == "tied" and layer.tied_to is not None and stage[layer.tied_to] != stage[index]:
            found.add("tied_across_stages")
        for source in layer.sources:
            if source < index - 1 and stage_of(source) != stage[index]:
                found.add("skip_across_stages")
                if stage[index] - stage_of(source) > 1:
                    found.add("skip_over_stage")
        if layer.input_name and spec.computes(index) and stage[index] > 0:
            found.add("kwarg_to_later_stage" if layer.kind == "kwarg" else "input_to_later_stage")
        if X in layer.sources and stage[index] > 0:
            found.add("input_to_later_stage")
    if any(stage[value] < n_stages - 1 for value in spec.outputs.values):
        found.add("output_from_early_stage")
    computing = [stage[k] for k in range(len(spec.layers)) if spec.computes(k)]
    if any(computing.count(s) == 1 for s in range(n_stages)):
        found.add("single_layer_stage")
    return found


def _stage_problems(min_stages: object, max_stages: object) -> list[str]:
    problems = []
    for name, value in (("min_stages", min_stages), ("max_stages", max_stages)):
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{name}={value!r} must be an int")
        elif value < 1:
            problems.append(f"{name}={value} must be at least 1")
    if (isinstance(min_stages, int) and isinstance(max_stages, int)
            and not problems and min_stages > max_stages):
        problems.append(f"min_stages={min_stages} is greater than max_stages={max_stages}; "
                        "pass min_stages <= max_stages")
    return problems


def _raise_if_any(function: str, problems: list[str]) -> None:
    if problems:
        listed = "\n".join(f"- {problem}" for problem in problems)
        raise InputError(f"invalid arguments to {function}():\n{listed}")
