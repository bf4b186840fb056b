"""Plain, immutable descriptions of random DAG models.

A :class:`ModelSpec` is the whole model as data: its inputs, its layers in
call order, its outputs, the batch size and the seed of its parameters::

    spec = ModelSpec(
        inputs=(InputSpec("x", "x", 4),),
        layers=(LayerSpec("linear", (X,), 8), LayerSpec("activation", (0,), 8, op="relu")),
        outputs=OutputSpec("single", (1,)),
        batch=4, seed=0)

Values are numbered: ``X`` (-1) is the main input ``x`` and ``k >= 0`` is the
output of layer ``k``. Layer ``k`` is the submodule ``f"l{k}"`` and reads only
values numbered below ``k``, so "cut before layer k" is the split_spec
``{f"l{k}": SplitPoint.BEGINNING}``.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, fields
from typing import Any, Literal

from pipecheck.errors import InputError

X = -1
"""The value number of the main positional input ``x``."""

LayerKind = Literal[
    "linear", "layernorm", "activation", "embedding", "add", "concat",
    "multiply", "buffer", "tied", "kwarg", "function", "running", "replicated", "dropout",
    "functional_dropout", "attention_dropout", "channel_dropout", "stochastic_depth", "checkpointed_dropout",
]
InputRole = Literal["x", "ids", "kwarg", "replicated"]
OutputKind = Literal["single", "tuple", "dict"]

ACTIVATIONS = ("relu", "gelu", "tanh")
BUFFER_OPS = ("mul", "add")
FUNCTION_OPS = ("reverse", "ste")  # gradient reversal; straight-through rounding
FEATURES = (
    "linear", "layernorm", "activation", "embedding", "residual", "concat", "multiply",
    "buffer", "tied", "kwarg", "kwarg_default", "multi_output", "dict_output",
    "function", "running", "replicated", "dropout", "functional_dropout", "attention_dropout",
    "channel_dropout", "stochastic_depth", "checkpointed_dropout",
)
"""Every name :func:`features` can report, in a fixed order."""

RANDOM_FEATURES = ("dropout", "functional_dropout", "attention_dropout", "channel_dropout", "stochastic_depth",
                   "checkpointed_dropout")
"""The features that draw random numbers in train mode, each with p = ``DROPOUT_P``: ``nn.Dropout``;
``F.dropout(h, p, training=self.training)`` in forward; ``scaled_dot_product_attention``'s ``dropout_p``
(self-attention over the features as tokens); ``nn.Dropout1d`` over channels of features (2 channels
of an even width, one feature each of an odd one); stochastic
depth (a residual branch scaled per sample by ``torch.empty(b, 1).bernoulli_(1 - p) / (1 - p)``); and a
Linear + ``F.dropout`` block under ``torch.utils.checkpoint`` (``use_reentrant=False``,
``preserve_rng_state=True``). They are checked by the runners that follow pipecheck's randomness
contract and refused by the others."""

OPT_IN = RANDOM_FEATURES
"""Features a model has only when asked for by name (``models(features=...)``): the random ones."""

DROPOUT_P = 0.25

_LAYER_FEATURE = {"add": "residual"}
_UNARY_SAME_WIDTH = ("layernorm", "activation", "buffer", "kwarg", "function", "running", "replicated", "dropout",
                     "functional_dropout", "attention_dropout", "channel_dropout", "checkpointed_dropout")


@dataclass(frozen=True, repr=False)
class InputSpec:
    """One model input.

    ``role`` is ``"x"`` (the float tensor ``(batch, width)`` passed first),
    ``"ids"`` (a LongTensor ``(batch,)`` of token ids in ``[0, width)``, passed
    second), ``"kwarg"`` (a keyword-only float tensor ``(batch, width)``) or
    ``"replicated"`` (a keyword-only float tensor ``(width,)`` without a batch
    dimension, which the check passes as ``pc.Replicated``).
    A kwarg with ``required=False`` defaults to None and is passed by
    ``make_inputs`` only when ``passed``.
    """

    name: str
    role: InputRole
    width: int
    required: bool = True
    passed: bool = True

    def __repr__(self) -> str:
        return _compact_repr(self, positional=3)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis' falsifying examples: stay compact


@dataclass(frozen=True, repr=False)
class LayerSpec:
    """One layer: its kind, the values it reads and the width of its output.

    Kind-specific fields: ``op`` (activation ``relu``/``gelu``/``tanh``;
    buffer ``mul``/``add``; function ``reverse``/``ste``: a custom
    autograd.Function), ``input_name`` (the model input an ``embedding``,
    ``kwarg`` or ``replicated`` layer reads), ``tied_to`` and ``transpose`` (a ``tied`` layer
    uses the weight Parameter of the earlier ``linear``/``embedding`` layer
    ``tied_to``, transposed or not), ``bias`` (``linear`` and ``tied``).
    A ``stochastic_depth`` layer reads ``(branch, skip)`` and returns ``skip + branch * mask``; the
    other random kinds (:data:`RANDOM_FEATURES`) read one value and keep its width.
    """

    kind: LayerKind
    sources: tuple[int, ...]
    width: int
    op: str = ""
    input_name: str = ""
    tied_to: int | None = None
    transpose: bool = False
    bias: bool = True

    def __repr__(self) -> str:
        return _compact_repr(self, positional=3)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis' falsifying examples: stay compact


@dataclass(frozen=True)
class OutputSpec:
    """What forward returns: one value, a tuple of values, or a dict ``{"hK": value K}``."""

    kind: OutputKind
    values: tuple[int, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        """The dict keys (for ``kind == "dict"``): ``"hK"`` for value ``K``."""
        return tuple(f"h{value}" for value in self.values)


@dataclass(frozen=True)
class ModelSpec:
    """A whole random model as data; checked on construction (raises InputError)."""

    inputs: tuple[InputSpec, ...]
    layers: tuple[LayerSpec, ...]
    outputs: OutputSpec
    batch: int
    seed: int

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            listed = "\n".join(f"- {problem}" for problem in problems)
            raise InputError(f"inconsistent ModelSpec ({len(problems)} problems):\n{listed}")

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Module FQNs of the layers in call order: ``("l0", "l1", ...)``."""
        return tuple(f"l{index}" for index in range(len(self.layers)))

    def input(self, name: str) -> InputSpec:
        """The input called ``name`` (KeyError when there is none)."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def width(self, value: int) -> int:
        """The width of value ``value`` (``X`` or a layer index)."""
        return self.inputs[0].width if value == X else self.layers[value].width

    def computes(self, layer: int) -> bool:
        """Whether layer ``layer`` computes anything when run on ``make_inputs(self)``.

        A kwarg layer whose optional input is not passed returns its input
        unchanged and traces to no node at all; a stage made only of such layers
        is empty, which splitters refuse.
        """
        spec = self.layers[layer]
        return spec.kind != "kwarg" or self.input(spec.input_name).passed

    def weight_shape(self, layer: int) -> tuple[int, int]:
        """Shape of the weight Parameter of a ``linear`` or ``embedding`` layer."""
        spec = self.layers[layer]
        if spec.kind == "embedding":
            return (self.input(spec.input_name).width, spec.width)
        return (spec.width, self.width(spec.sources[0]))


def features(spec: ModelSpec) -> set[str]:
    """Names (from :data:`FEATURES`) of the features ``spec`` uses."""
    found: set[str] = set()
    for layer in spec.layers:
        if layer.kind == "kwarg":
            found.add("kwarg" if spec.input(layer.input_name).required else "kwarg_default")
        else:
            found.add(_LAYER_FEATURE.get(layer.kind, layer.kind))
    if spec.outputs.kind == "tuple":
        found.add("multi_output")
    elif spec.outputs.kind == "dict":
        found.add("dict_output")
    return found


def _compact_repr(obj: InputSpec | LayerSpec, positional: int) -> str:
    """``Cls(a, b, c, field=value)`` listing keyword fields only when not at their default."""
    parts = []
    for index, spec_field in enumerate(fields(obj)):
        value = getattr(obj, spec_field.name)
        if index < positional:
            parts.append(repr(value))
        elif value != spec_field.default:
            parts.append(f"{spec_field.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def _problems(spec: ModelSpec) -> list[str]:
    problems = _input_problems(spec)
    if problems:
        return problems  # widths of layers cannot be checked against broken inputs
    if spec.batch < 1:
        problems.append(f"batch={spec.batch} must be at least 1")
    if not 0 <= spec.seed < 2**63 - 1:
        problems.append(f"seed={spec.seed} must be in [0, 2**63 - 1)")
    if not spec.layers:
        problems.append("layers=() is empty; a model needs at least one layer")
    for index, layer in enumerate(spec.layers):
        problems.extend(f"layer {index} {layer!r}: {why}" for why in _layer_problems(spec, index))
    problems.extend(_output_problems(spec))
    return problems


_RESERVED = re.compile(r"h\d+|self|torch|g|model|dtype")


def _input_problems(spec: ModelSpec) -> list[str]:
    problems = []
    if not spec.inputs or spec.inputs[0].role != "x":
        problems.append("inputs[0] must be the main input, with role 'x'")
    names = [spec.name for spec in spec.inputs]
    if len(set(names)) != len(names):
        problems.append(f"input names {names} are not unique")
    roles = [spec.role for spec in spec.inputs]
    if roles.count("x") > 1 or roles.count("ids") > 1:
        problems.append(f"roles {roles} hold more than one 'x' or 'ids' input")
    if "ids" in roles and roles.index("ids") != 1:
        problems.append("the 'ids' input must come second, right after 'x'")
    for spec_input in spec.inputs:
        name = spec_input.name
        if not name.isidentifier() or keyword.iskeyword(name) or _RESERVED.fullmatch(name):
            problems.append(f"input name {name!r} is not usable as a forward argument")
        if spec_input.width < 1:
            problems.append(f"input {name!r} has width={spec_input.width}; it must be >= 1")
        if spec_input.role in ("x", "ids", "replicated") and not (spec_input.required and spec_input.passed):
            problems.append(f"input {name!r} (role {spec_input.role!r}) must be required and passed")
        if spec_input.required and not spec_input.passed:
            problems.append(f"required kwarg {name!r} must be passed (passed=False)")
    return problems


def _layer_problems(spec: ModelSpec, index: int) -> list[str]:
    layer = spec.layers[index]
    if any(not X <= source < index for source in layer.sources):
        return [f"sources={layer.sources} must be earlier values, in [{X}, {index})"]
    arity = {"embedding": 0, "add": 2, "concat": 2, "multiply": 2, "stochastic_depth": 2}.get(layer.kind, 1)
    if len(layer.sources) != arity:
        return [f"a {layer.kind} layer reads {arity} values, not {len(layer.sources)}"]
    widths = [spec.width(source) for source in layer.sources]
    if layer.kind == "concat":
        expected = sum(widths)
    elif layer.kind in ("add", "multiply", "stochastic_depth", *_UNARY_SAME_WIDTH):
        expected = widths[0]
    else:  # linear, embedding and tied choose their width (tied is checked below)
        expected = layer.width
    problems = []
    if layer.width < 1 or layer.width != expected:
        problems.append(f"width={layer.width} should be {expected} (must be >= 1)")
    if layer.kind in ("add", "multiply", "stochastic_depth") and widths[0] != widths[1]:
        problems.append(f"reads values of different widths {widths}")
    if layer.kind == "activation" and layer.op not in ACTIVATIONS:
        problems.append(f"op={layer.op!r} is not one of {ACTIVATIONS}")
    if layer.kind == "buffer" and layer.op not in BUFFER_OPS:
        problems.append(f"op={layer.op!r} is not one of {BUFFER_OPS}")
    if layer.kind == "function" and layer.op not in FUNCTION_OPS:
        problems.append(f"op={layer.op!r} is not one of {FUNCTION_OPS}")
    if layer.kind in ("embedding", "kwarg", "replicated"):
        role = {"embedding": "ids", "kwarg": "kwarg", "replicated": "replicated"}[layer.kind]
        named = [spec_input for spec_input in spec.inputs if spec_input.name == layer.input_name]
        if not named or named[0].role != role:
            problems.append(f"input_name={layer.input_name!r} names no input with role {role!r}")
        elif layer.kind != "embedding" and named[0].width != layer.width:
            problems.append(f"{layer.kind} input {layer.input_name!r} has width {named[0].width}")
    if layer.kind == "tied":
        problems.extend(_tied_problems(spec, index, widths[0]))
    return problems


def _tied_problems(spec: ModelSpec, index: int, in_width: int) -> list[str]:
    layer = spec.layers[index]
    owner = layer.tied_to
    if owner is None or not 0 <= owner < index:
        return [f"tied_to={owner} must be an earlier layer index"]
    if spec.layers[owner].kind not in ("linear", "embedding"):
        return [f"tied_to={owner} is a {spec.layers[owner].kind} layer, not linear/embedding"]
    rows, cols = spec.weight_shape(owner)
    shape = (cols, rows) if layer.transpose else (rows, cols)
    if (layer.width, in_width) != shape:
        return [f"maps width {in_width} to {layer.width}, but the tied weight "
                f"(transpose={layer.transpose}) maps {shape[1]} to {shape[0]}"]
    return []


def _output_problems(spec: ModelSpec) -> list[str]:
    values = spec.outputs.values
    problems = []
    if spec.outputs.kind not in ("single", "tuple", "dict"):
        problems.append(f"outputs.kind={spec.outputs.kind!r} is not single, tuple or dict")
    if not values or len(set(values)) != len(values):
        problems.append(f"outputs.values={values} must be distinct and non-empty")
    if spec.outputs.kind == "single" and len(values) != 1:
        problems.append(f"a single output has one value, not {values}")
    if any(not 0 <= value < len(spec.layers) for value in values):
        problems.append(f"outputs.values={values} must be layer indices")
    return problems
