"""The ``models()`` strategy: random :class:`ModelSpec` values.

::

    @given(pst.models(max_layers=4, features=["linear", "tied"]))
    def test_split(spec):
        model, (args, kwargs) = pst.build(spec), pst.make_inputs(spec)

Each model is a backbone (every layer reads the previous layer's output) with
skip edges: residual adds, multiplies and concats also read an earlier value,
tied layers reuse an earlier layer's weight. So no layer's output is dead and
every parameter gets a gradient; and every model has a parameter, unless
``features`` allows neither linear nor layernorm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hypothesis import strategies as st

from pipecheck.errors import InputError
from pipecheck.strategies._internal.description import (
    ACTIVATIONS,
    BUFFER_OPS,
    FEATURES,
    FUNCTION_OPS,
    OPT_IN,
    InputSpec,
    LayerSpec,
    ModelSpec,
    OutputSpec,
    X,
)

T = TypeVar("T")

# A feature that needs another to be built at all brings it along.
IMPLIED = {"concat": ("linear",), "embedding": ("residual",)}
# The slots a layer's kind is picked from: features that fit at any position (a model may be made of these
# alone) and features that join a second value (or weight) to the stream, when one fits. The "dropout" slot
# holds every random layer of _RANDOM_UNARY and the "residual" slot stochastic depth too (a residual branch
# kept or dropped): a model without random features draws the very choices it did before they existed.
_ANYWHERE = ("linear", "layernorm", "activation", "buffer", "kwarg", "kwarg_default", "function", "running",
             "replicated", "dropout")
_JOINS = ("residual", "multiply", "concat", "embedding", "tied")
# Random layers that read the previous value and keep its width, simplest first.
_RANDOM_UNARY = ("dropout", "functional_dropout", "attention_dropout", "channel_dropout", "checkpointed_dropout")
# Features that fit at any position.
_FIT_ANYWHERE = (*_ANYWHERE, *_RANDOM_UNARY[1:])
# Layer kinds with parameters of their own (a tied layer's weight is another's).
_WITH_PARAMETERS = ("linear", "layernorm", "embedding", "checkpointed_dropout")


@dataclass(frozen=True)
class _Config:
    min_layers: int
    max_layers: int
    min_width: int
    max_width: int
    allowed: tuple[str, ...]
    batch: int


def models(
    *,
    min_layers: int = 1,
    max_layers: int = 8,
    min_width: int = 2,
    max_width: int = 16,
    features: Iterable[str] | None = None,
    batch: int = 4,
) -> st.SearchStrategy[ModelSpec]:
    """Random DAG models as :class:`ModelSpec` (turn one into a module with ``build``).

    ``features`` limits the features used (names from ``FEATURES``; None allows
    all but the random ones, ``RANDOM_FEATURES``: dropout in its forms, stochastic
    depth, a checkpointed block with dropout, each drawn only when named). A
    feature brings what it needs: ``concat`` its Linear projecting back,
    ``embedding`` the add that joins it to the stream. Every width (and the
    vocabulary of ``ids``) lies in ``[min_width, max_width]``, except a
    concat's output: the sum of its two inputs' widths. Every layer's output
    is used, and a model has parameters unless ``features`` allows neither
    linear nor layernorm.

    Shrinks towards fewer layers (deleted anywhere, not only at the end),
    fewer features (one on/off flag per allowed feature, shrinking to off; with
    all off every layer is the first allowed of linear, layernorm, activation,
    buffer, kwarg, kwarg_default), ``min_width``, earlier skip sources, no
    biases, optional kwargs not passed, a single output, and seed 0. E.g. the
    smallest model with a tied weight is ``l0 = Linear(2, 2)`` and ``l1`` tied to it.
    """
    if isinstance(features, Iterator):  # drawn from again later: keep a copy that survives
        features = tuple(features)
    _checked(min_layers, max_layers, min_width, max_width, features, batch)
    return _models(min_layers=min_layers, max_layers=max_layers, min_width=min_width,
                   max_width=max_width, features=features, batch=batch)


def _draw_models(
    draw: st.DrawFn,
    *,
    min_layers: int = 1,
    max_layers: int = 8,
    min_width: int = 2,
    max_width: int = 16,
    features: Iterable[str] | None = None,
    batch: int = 4,
) -> ModelSpec:
    config = _checked(min_layers, max_layers, min_width, max_width, features, batch)
    enabled = {feature for feature in config.allowed if draw(st.booleans())}
    enabled.update(implied for feature in set(enabled) for implied in IMPLIED.get(feature, ()))
    draft = _Draft(config, x_width=draw(_widths(config)))
    blocks = draw(st.lists(_choices(config), min_size=config.min_layers,
                           max_size=config.max_layers))
    while len(draft.layers) < len(blocks):
        draft.add_layer(blocks[len(draft.layers):], enabled)
    outputs = draft.outputs(draw, enabled)
    seed = draw(st.integers(0, 2**32 - 1))
    # x, ids, then required kwargs before optional ones: torch.fx writes keyword-only
    # arguments as ordinary ones, and "k1=None, k2" would be a SyntaxError.
    inputs = sorted(draft.inputs, key=lambda spec: _INPUT_ORDER[spec.role] + (not spec.required))
    return ModelSpec(tuple(inputs), tuple(draft.layers), outputs, config.batch, seed)


_INPUT_ORDER = {"x": 0, "ids": 1, "kwarg": 2, "replicated": 2}  # keyword-only ones last, required first


# hypothesis builds a strategy's repr from the function's name and the arguments
# given, so naming the drawing function "models" makes repr reproduce the call.
_draw_models.__name__ = _draw_models.__qualname__ = "models"
_models = st.composite(_draw_models)


def _widths(config: _Config) -> st.SearchStrategy[int]:
    return st.integers(config.min_width, config.max_width)


@dataclass(frozen=True)
class _Choices:
    """The block of choices behind one layer, the same whatever the layer's kind.

    The layers are a ``st.lists`` of these blocks, read in order, so hypothesis
    shrinks a model by deleting blocks (layers) and by lowering each choice to
    its simplest value. hypothesis prefers SHORTER choice sequences over
    smaller values: if a kind drew fewer choices than a Linear it would count
    as "simpler", so every kind reads the same block.
    """

    join: bool  # a kind of _JOINS rather than of _ANYWHERE, if one is enabled and fits
    kind: int  # the kind: see _kind_at
    flag: bool  # a bias; whether an optional kwarg is passed; stochastic depth rather than a residual
    reuse: bool  # reuse a width, or a kwarg input, seen before
    width: int
    pick: int  # which candidate: op, skip source, tie owner, reused kwarg, random layer

    def among(self, options: Sequence[T]) -> T:
        return options[self.pick % len(options)]


def _kind_at(order: tuple[str, ...], available: set[str], pick: int) -> str | None:
    """The first available kind of ``order`` from position ``pick`` on, cyclically.

    Indexing the fixed ``order`` (not the list of kinds available here) keeps a
    block's kind when shrinking deletes earlier layers; ``pick`` 0 is the first.
    """
    for offset in range(len(order)):
        kind = order[(pick + offset) % len(order)]
        if kind in available:
            return kind
    return None


def _choices(config: _Config) -> st.SearchStrategy[_Choices]:
    return st.builds(_Choices, st.booleans(), st.integers(0, 255), st.booleans(),
                     st.booleans(), _widths(config), st.integers(0, 255))


@dataclass
class _Draft:
    """A model being drawn: inputs and layers so far, and the width of each value."""

    config: _Config
    x_width: int
    inputs: list[InputSpec] = field(default_factory=list)
    layers: list[LayerSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.inputs.append(InputSpec("x", "x", self.x_width))

    def width(self, value: int) -> int:
        return self.x_width if value == X else self.layers[value].width

    def add_layer(self, blocks: Sequence[_Choices], enabled: set[str]) -> None:
        """Append the layer of ``blocks[0]``; concat and embedding also use ``blocks[1]``."""
        choices, remaining = blocks[0], len(blocks)
        previous = len(self.layers) - 1  # X when this is the first layer
        width = self.width(previous)
        same_width = [value for value in range(X, previous) if self.width(value) == width]
        owners = self._tie_owners(width)
        feasible = {
            "residual": bool(same_width), "multiply": bool(same_width), "tied": bool(owners),
            "concat": remaining >= 2, "embedding": remaining >= 2, "stochastic_depth": bool(same_width),
        }
        available = {kind for kind in enabled if feasible.get(kind, True)}
        if remaining == 1 and not any(layer.kind in _WITH_PARAMETERS for layer in self.layers):
            # The last layer of a model without parameters: give it one, so there are
            # gradients to check (unless ``features`` rules out both kinds below).
            weighted = {"linear", "layernorm"} & set(self.config.allowed)
            if weighted:
                available = (available & weighted) or {min(weighted, key=_ANYWHERE.index)}
        slots = available | {slot for slot, kinds in (("dropout", _RANDOM_UNARY), ("residual", ("stochastic_depth",)))
                             if available & set(kinds)}
        chain = _kind_at(_ANYWHERE, slots, choices.kind)
        join = _kind_at(_JOINS, slots, choices.kind)
        kind = (join if choices.join else chain) or chain or join
        if kind == "dropout":  # a random layer: the first enabled from pick on (nn.Dropout when pick is 0)
            kind = _kind_at(_RANDOM_UNARY, available, choices.pick)
        elif kind == "residual" and "stochastic_depth" in available and (choices.flag or "residual" not in available):
            kind = "stochastic_depth"
        if kind is None:  # no enabled kind fits here
            kind = next(kind for kind in _FIT_ANYWHERE if kind in self.config.allowed)
        add = self.layers.append
        if kind == "linear":
            add(LayerSpec("linear", (previous,), self._out_width(choices), bias=choices.flag))
        elif kind in ("layernorm", "activation", "buffer", "function", "running", *_RANDOM_UNARY):
            op = {"activation": ACTIVATIONS, "buffer": BUFFER_OPS, "function": FUNCTION_OPS}.get(kind)
            add(LayerSpec(kind, (previous,), width,  # type: ignore[arg-type]
                          op=choices.among(op) if op else ""))
        elif kind == "replicated":
            add(LayerSpec("replicated", (previous,), width, input_name=self._replicated(choices, width)))
        elif kind in ("kwarg", "kwarg_default"):
            name = self._kwarg(choices, width, required=kind == "kwarg")
            add(LayerSpec("kwarg", (previous,), width, input_name=name))
        elif kind in ("residual", "multiply", "stochastic_depth"):
            other = choices.among(same_width)  # stochastic depth: the branch since ``other``, kept or dropped
            add(LayerSpec({"residual": "add"}.get(kind, kind), (previous, other), width))  # type: ignore[arg-type]
        elif kind == "concat":
            other = choices.among(range(X, previous + 1))
            add(LayerSpec("concat", (previous, other), width + self.width(other)))
            projection = blocks[1]
            add(LayerSpec("linear", (previous + 1,), self._out_width(projection),
                          bias=projection.flag))
        elif kind == "embedding":
            add(LayerSpec("embedding", (), width, input_name=self._ids(choices.width)))
            add(LayerSpec("add", (previous + 1, previous), width))
        else:
            owner, transpose = choices.among(owners)
            rows, cols = self._weight_shape(owner)
            add(LayerSpec("tied", (previous,), cols if transpose else rows, tied_to=owner,
                          transpose=transpose, bias=choices.flag))

    def outputs(self, draw: st.DrawFn, enabled: set[str]) -> OutputSpec:
        last = len(self.layers) - 1
        kinds = [kind for kind, feature in (("tuple", "multi_output"), ("dict", "dict_output"))
                 if feature in enabled]
        if not kinds:
            return OutputSpec("single", (last,))
        kind = draw(st.sampled_from(kinds))
        earlier = st.lists(st.sampled_from(range(last)), min_size=1, max_size=3, unique=True)
        extra = draw(earlier) if last > 0 else []
        return OutputSpec(kind, (last, *extra))  # type: ignore[arg-type]

    def _out_width(self, choices: _Choices) -> int:
        """A Linear's output width: often one seen before, so that adds and ties can fit."""
        low, high = self.config.min_width, self.config.max_width
        seen = sorted({self.width(value) for value in range(X, len(self.layers))}
                      & set(range(low, high + 1)))
        return choices.among(seen) if seen and choices.reuse else choices.width

    def _weight_shape(self, layer: int) -> tuple[int, int]:
        spec = self.layers[layer]
        if spec.kind == "embedding":
            return (self.inputs[1].width, spec.width)
        return (spec.width, self.width(spec.sources[0]))

    def _tie_owners(self, in_width: int) -> list[tuple[int, bool]]:
        """(owner layer, transpose) pairs taking ``in_width`` to a width within bounds."""
        owners = []
        for index, layer in enumerate(self.layers):
            if layer.kind in ("linear", "embedding"):
                rows, cols = self._weight_shape(index)
                low, high = self.config.min_width, self.config.max_width
                owners += [(index, transpose)
                           for transpose, accepts, out in ((False, cols, rows), (True, rows, cols))
                           if accepts == in_width and low <= out <= high]
        return owners

    def _ids(self, vocab: int) -> str:
        """The token-id input (created with ``vocab`` ids by the first embedding)."""
        if len(self.inputs) < 2 or self.inputs[1].role != "ids":
            self.inputs.insert(1, InputSpec("ids", "ids", vocab))
        return "ids"

    def _replicated(self, choices: _Choices, width: int) -> str:
        """The name of a per-feature input of ``width`` (no batch dimension): an earlier one or new."""
        reusable = [spec.name for spec in self.inputs if spec.role == "replicated" and spec.width == width]
        if reusable and choices.reuse:
            return choices.among(reusable)
        name = f"s{sum(spec.role == 'replicated' for spec in self.inputs)}"
        self.inputs.append(InputSpec(name, "replicated", width))
        return name

    def _kwarg(self, choices: _Choices, width: int, required: bool) -> str:
        """The name of a keyword input of ``width``: an earlier one (shared by layers) or new."""
        reusable = [spec.name for spec in self.inputs
                    if spec.role == "kwarg" and spec.required == required and spec.width == width]
        if reusable and choices.reuse:
            return choices.among(reusable)
        name = f"k{sum(spec.role == 'kwarg' for spec in self.inputs)}"
        passed = required or choices.flag
        self.inputs.append(InputSpec(name, "kwarg", width, required=required, passed=passed))
        return name


def _checked(
    min_layers: int, max_layers: int, min_width: int, max_width: int,
    features: Iterable[str] | None, batch: int,
) -> _Config:
    """The validated arguments of ``models()``; raises InputError listing every problem."""
    given = {"min_layers": min_layers, "max_layers": max_layers, "min_width": min_width,
             "max_width": max_width, "batch": batch}
    problems = []
    for name, value in given.items():
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{name}={value!r} must be an int")
        elif value < 1 and name in ("min_layers", "min_width", "batch"):
            problems.append(f"{name}={value} must be at least 1")
    for low, high in (("min_layers", "max_layers"), ("min_width", "max_width")):
        low_value, high_value = given[low], given[high]
        if isinstance(low_value, int) and isinstance(high_value, int) and low_value > high_value:
            problems.append(f"{low}={low_value} is greater than {high}={high_value}; "
                            f"pass {low} <= {high}")
    allowed, feature_problems = _allowed_features(features)
    problems += feature_problems
    if problems:
        listed = "\n".join(f"- {problem}" for problem in problems)
        raise InputError(f"invalid arguments to models():\n{listed}")
    return _Config(min_layers, max_layers, min_width, max_width, allowed, batch)


def _allowed_features(features: object) -> tuple[tuple[str, ...], list[str]]:
    if features is None:
        return tuple(feature for feature in FEATURES if feature not in OPT_IN), []
    if isinstance(features, str) or not isinstance(features, Iterable):
        return (), [f"features={features!r} must be a collection of feature names, "
                    f"e.g. features=[{features!r}]"]
    names = list(features)
    unknown = [name for name in names if name not in FEATURES]
    if unknown:
        return (), [f"features={names!r} has unknown names {unknown}; "
                    f"choose from {list(FEATURES)}"]
    wanted = set(names)
    wanted.update(implied for name in names for implied in IMPLIED.get(name, ()))
    problems = []
    if not wanted & set(_FIT_ANYWHERE):
        problems.append(f"features={names!r} has no layer that fits at any position; "
                        f"add one of {list(_FIT_ANYWHERE)}")
    if "tied" in wanted and not wanted & {"linear", "embedding"}:
        problems.append(f"features={names!r} has 'tied' but no layer owning a weight to tie "
                        "to; add 'linear' or 'embedding'")
    return tuple(feature for feature in FEATURES if feature in wanted), problems
