"""Turn a :class:`ModelSpec` into a module, its inputs, or stand-alone source.

::

    model = build(spec)                 # same spec -> bit-identical parameters
    args, kwargs = make_inputs(spec)    # same spec -> identical tensors
    print(to_source(spec))              # a script that rebuilds both, importing only torch

``build`` and ``to_source`` share one code generator: the model class is
written as Python source once, executed by ``build`` and printed by
``to_source``; the layer classes are the ones in ``layers.py``, copied into the
script verbatim. Parameters and buffers come from
``torch.Generator().manual_seed(spec.seed)``, filled in one fixed order (the
"init plan"); the global RNG is never touched.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import operator
from dataclasses import dataclass
from typing import Any

import torch

from pipecheck.errors import InputError
from pipecheck.strategies._internal import layers
from pipecheck.strategies._internal.description import DROPOUT_P, LayerSpec, ModelSpec, X

_ACTIVATION_CLASS = {"relu": "ReLU", "gelu": "GELU", "tanh": "Tanh"}
_CUSTOM_CLASS = {
    "add": layers.Add, "multiply": layers.Multiply, "concat": layers.Concat,
    "tied": layers.TiedLinear, "kwarg": layers.AddInput, "running": layers.RunningMean,
    "replicated": layers.ScaleByInput,
}
# The random layers (RANDOM_FEATURES but nn.Dropout), each made with its probability DROPOUT_P.
_RANDOM_CLASS = {
    "functional_dropout": layers.FunctionalDropout, "attention_dropout": layers.AttentionDropout,
    "channel_dropout": layers.ChannelDropout, "stochastic_depth": layers.StochasticDepth,
    "checkpointed_dropout": layers.CheckpointedDropout,
}
_BUFFER_CLASS = {"mul": layers.Scale, "add": layers.Shift}
_FUNCTION_CLASS = {"reverse": layers.ReverseGradient, "ste": layers.StraightThrough}
# A layer's custom autograd.Function, written into a script before the layer that applies it.
_AUTOGRAD_FUNCTION: dict[type, type] = {layers.ReverseGradient: layers.GradReverse,
                                         layers.StraightThrough: layers.RoundSTE}
_LAYER_CLASSES: tuple[type, ...] = (*_AUTOGRAD_FUNCTION.values(), *_CUSTOM_CLASS.values(), *_BUFFER_CLASS.values(),
                  *_FUNCTION_CLASS.values(), *_RANDOM_CLASS.values())


@dataclass(frozen=True)
class InitStep:
    """Fill ``target`` (a parameter or buffer FQN) with ``uniform_(g, shape, center, bound)``."""

    target: str
    shape: tuple[int, ...]
    center: float
    bound: float


def build(spec: ModelSpec) -> torch.nn.Module:
    """A fresh module computing ``spec``; the same spec gives bit-identical parameters.

    Each layer is the submodule ``f"l{k}"``; forward calls them in index
    order. ``type(model).spec`` is ``spec``. The module pickles (and deep-copies)
    like any other, so it can travel to worker processes; so does the factory
    ``functools.partial(build, spec)``.
    """
    model = _model_class(spec)()
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for step in init_plan(spec):
            operator.attrgetter(step.target)(model).copy_(
                layers.uniform_(generator, step.shape, step.center, step.bound)
            )
    return model


@functools.lru_cache(maxsize=512)
def _model_class(spec: ModelSpec) -> type[torch.nn.Module]:
    """The class ``Model`` of ``to_source(spec)``, made once per spec and process."""
    source = _model_class_source(spec)
    filename = f"<pipecheck model {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
    # Registered so that tracebacks and fx error messages can show the forward code.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "__name__": "pipecheck_generated"}
    namespace.update({cls.__name__: cls for cls in _LAYER_CLASSES})
    exec(compile(source, filename, "exec"), namespace)
    model_class: type[torch.nn.Module] = namespace["Model"]
    model_class.spec = spec  # type: ignore[attr-defined]
    model_class.__reduce__ = _reduce  # type: ignore[method-assign,assignment]
    return model_class


def _reduce(model: torch.nn.Module) -> tuple[Any, ...]:
    # pickle cannot import a class made by exec: name a function that remakes it
    # from the spec instead, and let the instance's state (tied Parameters
    # included, by pickle's memo) restore everything else, as it does by default.
    return (_blank_model, (type(model).spec,), model.__getstate__())  # type: ignore[attr-defined]


def _blank_model(spec: ModelSpec) -> torch.nn.Module:
    """An uninitialised instance of ``spec``'s class, for pickle to fill in."""
    model_class = _model_class(spec)
    return model_class.__new__(model_class)


def make_inputs(
    spec: ModelSpec, dtype: torch.dtype = torch.float32, *, seed: int | None = None
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """``(args, kwargs)`` for ``build(spec)``, drawn from a generator seeded ``spec.seed + 1``.

    Float inputs are drawn in float32 and then cast, so every ``dtype`` sees
    the same values. Optional kwargs with ``passed=False`` are left out.
    ``seed`` replaces the generator's seed (other values, same shapes).
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"make_inputs(dtype={dtype!r}): dtype must be a floating torch.dtype, "
                         "e.g. dtype=torch.float64")
    generator = torch.Generator().manual_seed(spec.seed + 1 if seed is None else seed)
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    for spec_input in spec.inputs:
        if not spec_input.passed:
            continue
        if spec_input.role == "ids":
            value = torch.randint(0, spec_input.width, (spec.batch,), generator=generator)
        elif spec_input.role == "replicated":  # no batch dimension: every micro-batch gets it whole
            value = torch.randn((spec_input.width,), generator=generator).to(dtype)
        else:
            value = torch.randn((spec.batch, spec_input.width), generator=generator).to(dtype)
        if spec_input.role in ("kwarg", "replicated"):
            kwargs[spec_input.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def to_source(spec: ModelSpec) -> str:
    """Python source that rebuilds ``build(spec)`` and ``make_inputs(spec)`` stand-alone.

    The script imports only torch and defines ``Model``, ``make_model()`` (the
    same parameters as ``build(spec)``, bit for bit) and
    ``make_inputs(dtype=torch.float32)``; run as ``__main__`` it prints the outputs. A
    ``replicated`` input is a plain tensor there (the check wraps it in ``pc.Replicated``).
    """
    return script(spec, [], [
        'if __name__ == "__main__":\n'
        "    args, kwargs = make_inputs()\n"
        "    print(make_model()(*args, **kwargs))\n",
    ])


def script(spec: ModelSpec, imports: list[str], tail: list[str]) -> str:
    """``to_source(spec)`` with ``imports`` after ``import torch`` and ``tail`` instead of its main.

    Shared with :meth:`PipelineCase.repro`, which appends the check's call.
    """
    in_use: set[Any] = {_class_of(layer) for layer in spec.layers}
    in_use |= {_AUTOGRAD_FUNCTION[cls] for cls in in_use if cls in _AUTOGRAD_FUNCTION}
    used = [cls for cls in _LAYER_CLASSES if cls in in_use]
    header = "\n".join(["import torch", *(["", *imports] if imports else [])])
    parts = [
        f'"""A model generated by pipecheck.strategies (seed={spec.seed}).\n\n'
        f'{_wrap_comment(repr(spec))}\n"""\n\n{header}\n',
        _source_text(layers.uniform_),
        *(_source_text(cls) for cls in used),
        _model_class_source(spec),
        _make_model_source(spec),
        _make_inputs_source(spec),
        *tail,
    ]
    return "\n\n".join(part.rstrip("\n") + "\n" for part in parts)


@functools.cache
def _source_text(definition: Any) -> str:
    return inspect.getsource(definition)  # read from disk: once per process is enough


def init_plan(spec: ModelSpec) -> list[InitStep]:
    """Which tensors ``build`` fills from the seeded generator, in order.

    Linear-like weights and biases lie in ``±1/sqrt(fan_in)``; LayerNorm
    weights in ``1 ± 0.1``; embeddings and shifts in ``±1``; scales in
    ``1 ± 0.5``. A tied layer's weight belongs to its owner and is filled once.
    """
    steps = []
    for index, layer in enumerate(spec.layers):
        name = f"l{index}"
        in_width = spec.width(layer.sources[0]) if layer.sources else 0
        if layer.kind == "linear":
            bound = 1.0 / in_width**0.5
            steps.append(InitStep(f"{name}.weight", (layer.width, in_width), 0.0, bound))
            if layer.bias:
                steps.append(InitStep(f"{name}.bias", (layer.width,), 0.0, bound))
        elif layer.kind == "layernorm":
            steps.append(InitStep(f"{name}.weight", (layer.width,), 1.0, 0.1))
            steps.append(InitStep(f"{name}.bias", (layer.width,), 0.0, 0.1))
        elif layer.kind == "embedding":
            steps.append(InitStep(f"{name}.weight", spec.weight_shape(index), 0.0, 1.0))
        elif layer.kind == "tied" and layer.bias:
            steps.append(InitStep(f"{name}.bias", (layer.width,), 0.0, 1.0 / in_width**0.5))
        elif layer.kind == "buffer":
            target, center, bound = ("scale", 1.0, 0.5) if layer.op == "mul" else ("shift", 0.0, 1.0)
            steps.append(InitStep(f"{name}.{target}", (layer.width,), center, bound))
        elif layer.kind == "running":
            steps.append(InitStep(f"{name}.mean", (layer.width,), 0.0, 0.1))
        elif layer.kind == "checkpointed_dropout":
            bound = 1.0 / in_width**0.5
            steps.append(InitStep(f"{name}.linear.weight", (layer.width, in_width), 0.0, bound))
            steps.append(InitStep(f"{name}.linear.bias", (layer.width,), 0.0, bound))
    return steps


def _class_of(layer: LayerSpec) -> type[torch.nn.Module] | None:
    if layer.kind == "buffer":
        return _BUFFER_CLASS[layer.op]
    if layer.kind == "function":
        return _FUNCTION_CLASS[layer.op]
    return _CUSTOM_CLASS.get(layer.kind) or _RANDOM_CLASS.get(layer.kind)


def _value_name(spec: ModelSpec, value: int) -> str:
    return spec.inputs[0].name if value == X else f"h{value}"


def _constructor(spec: ModelSpec, index: int) -> str:
    layer = spec.layers[index]
    skip_init = "torch.nn.utils.skip_init"  # builds on the meta device: no RNG, no init
    if layer.kind == "linear":
        in_width = spec.width(layer.sources[0])
        return f"{skip_init}(torch.nn.Linear, {in_width}, {layer.width}, bias={layer.bias})"
    if layer.kind == "layernorm":
        return f"{skip_init}(torch.nn.LayerNorm, {layer.width})"
    if layer.kind == "embedding":
        vocab, dim = spec.weight_shape(index)
        return f"{skip_init}(torch.nn.Embedding, {vocab}, {dim})"
    if layer.kind == "activation":
        return f"torch.nn.{_ACTIVATION_CLASS[layer.op]}()"
    if layer.kind == "dropout":
        return f"torch.nn.Dropout({DROPOUT_P})"
    if layer.kind == "checkpointed_dropout":
        return f"CheckpointedDropout({layer.width}, {DROPOUT_P})"
    if layer.kind == "channel_dropout":  # 2 channels of an even width, one feature each of an odd one
        return f"ChannelDropout({DROPOUT_P}, {2 if layer.width % 2 == 0 else layer.width})"
    if layer.kind in _RANDOM_CLASS:
        return f"{_RANDOM_CLASS[layer.kind].__name__}({DROPOUT_P})"
    if layer.kind in ("buffer", "running"):
        return f"{_class_of(layer).__name__}({layer.width})"  # type: ignore[union-attr]
    if layer.kind == "function":
        return f"{_FUNCTION_CLASS[layer.op].__name__}()"
    if layer.kind == "tied":
        return (f"TiedLinear(self.l{layer.tied_to}.weight, "
                f"transpose={layer.transpose}, bias={layer.bias})")
    return f"{_CUSTOM_CLASS[layer.kind].__name__}()"


def _call(spec: ModelSpec, index: int) -> str:
    layer = spec.layers[index]
    arguments = [_value_name(spec, source) for source in layer.sources]
    if layer.input_name:
        arguments.append(layer.input_name)
    return f"h{index} = self.l{index}({', '.join(arguments)})"


def _signature(spec: ModelSpec) -> str:
    tensor = "torch.Tensor"
    positional = [f"{spec_input.name}: {tensor}" for spec_input in spec.inputs
                  if spec_input.role in ("x", "ids")]
    keyword = [
        f"{spec_input.name}: {tensor}" if spec_input.required
        else f"{spec_input.name}: {tensor} | None = None"
        for spec_input in spec.inputs if spec_input.role in ("kwarg", "replicated")
    ]
    arguments = ["self", *positional, *(["*", *keyword] if keyword else [])]
    returns = {"single": tensor, "tuple": f"tuple[{tensor}, ...]",
               "dict": f"dict[str, {tensor}]"}[spec.outputs.kind]
    return f"def forward({', '.join(arguments)}) -> {returns}:"


def _return(spec: ModelSpec) -> str:
    names = [f"h{value}" for value in spec.outputs.values]
    if spec.outputs.kind == "single":
        return f"return {names[0]}"
    if spec.outputs.kind == "tuple":
        return f"return ({', '.join(names)},)" if len(names) == 1 else f"return ({', '.join(names)})"
    items = ", ".join(f"{key!r}: {name}" for key, name in zip(spec.outputs.keys, names, strict=True))
    return f"return {{{items}}}"


def _model_class_source(spec: ModelSpec) -> str:
    lines = [
        "class Model(torch.nn.Module):",
        "    def __init__(self) -> None:",
        "        super().__init__()",
        *(f"        self.l{index} = {_constructor(spec, index)}" for index in range(len(spec.layers))),
        "",
        f"    {_signature(spec)}",
        *(f"        {_call(spec, index)}" for index in range(len(spec.layers))),
        f"        {_return(spec)}",
    ]
    return "\n".join(lines) + "\n"


def _make_model_source(spec: ModelSpec) -> str:
    lines = [
        "def make_model() -> Model:",
        "    model = Model()",
        f"    g = torch.Generator().manual_seed({spec.seed})",
        "    with torch.no_grad():",
        *(f"        model.{step.target}.copy_(uniform_(g, {step.shape!r}, "
          f"{step.center!r}, {step.bound!r}))" for step in init_plan(spec)),
        "    return model",
    ]
    if lines[-2].endswith("torch.no_grad():"):  # nothing to fill: no parameters at all
        lines[-2:] = ["    return model"]
    return "\n".join(lines) + "\n"


def _make_inputs_source(spec: ModelSpec) -> str:
    lines = [
        "def make_inputs(",
        "    dtype: torch.dtype = torch.float32,",
        ") -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:",
        f"    g = torch.Generator().manual_seed({spec.seed + 1})",
    ]
    args: list[str] = []
    kwargs: list[str] = []
    for spec_input in spec.inputs:
        if not spec_input.passed:
            continue
        name = spec_input.name
        if spec_input.role == "ids":
            lines.append(f"    {name} = torch.randint(0, {spec_input.width}, "
                         f"({spec.batch},), generator=g)")
        elif spec_input.role == "replicated":
            lines.append(f"    {name} = torch.randn(({spec_input.width},), generator=g).to(dtype)")
        else:
            lines.append(f"    {name} = torch.randn(({spec.batch}, {spec_input.width}), "
                         "generator=g).to(dtype)")
        (kwargs if spec_input.role in ("kwarg", "replicated") else args).append(name)
    packed_args = f"({', '.join(args)},)"
    packed_kwargs = "{" + ", ".join(f"{name!r}: {name}" for name in kwargs) + "}"
    lines.append(f"    return {packed_args}, {packed_kwargs}")
    return "\n".join(lines) + "\n"


def _wrap_comment(text: str, width: int = 96) -> str:
    """Break a long repr at ", " so the docstring stays readable."""
    lines, current = [], ""
    for piece in text.split(", "):
        if current and len(current) + len(piece) + 2 > width:
            lines.append(current + ",")
            current = piece
        else:
            current = f"{current}, {piece}" if current else piece
    lines.append(current)
    return "\n".join(lines)
