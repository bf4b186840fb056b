"""Tests of pipecheck.strategies: models(), ModelSpec, build, make_inputs, to_source."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, find, given, settings

from pipecheck import strategies as pst
from pipecheck.errors import InputError
from pipecheck.strategies import InputSpec, LayerSpec, ModelSpec, OutputSpec

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every feature but multi_output (a model returns a tuple or a dict, not both).
ALL_BUT_TUPLE = ModelSpec(
    inputs=(
        InputSpec("x", "x", 4),
        InputSpec("ids", "ids", 5),
        InputSpec("k0", "kwarg", 6),
        InputSpec("s0", "replicated", 5),
        InputSpec("k1", "kwarg", 6, required=False, passed=False),
    ),
    layers=(
        LayerSpec("linear", (-1,), 6),
        LayerSpec("layernorm", (0,), 6),
        LayerSpec("activation", (1,), 6, op="gelu"),
        LayerSpec("embedding", (), 6, input_name="ids"),
        LayerSpec("add", (3, 2), 6),
        LayerSpec("kwarg", (4,), 6, input_name="k0"),
        LayerSpec("buffer", (5,), 6, op="mul"),
        LayerSpec("concat", (6, -1), 10),
        LayerSpec("linear", (7,), 6, bias=False),
        LayerSpec("multiply", (8, 1), 6),
        LayerSpec("kwarg", (9,), 6, input_name="k1"),
        LayerSpec("tied", (10,), 4, tied_to=0, transpose=True, bias=False),
        LayerSpec("tied", (11,), 6, tied_to=0),
        LayerSpec("tied", (12,), 5, tied_to=3),
        LayerSpec("function", (13,), 5, op="reverse"),
        LayerSpec("running", (14,), 5),
        LayerSpec("replicated", (15,), 5, input_name="s0"),
        LayerSpec("function", (16,), 5, op="ste"),
    ),
    outputs=OutputSpec("dict", (17, 4, 0)),
    batch=3,
    seed=7,
)


def leaves(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    values = outputs.values() if isinstance(outputs, dict) else outputs
    return [leaf for value in values for leaf in leaves(value)]


def random_projection(outputs: Any) -> torch.Tensor:
    """A scalar that weighs every output element differently (a sum would hide mix-ups)."""
    generator = torch.Generator().manual_seed(0)
    return sum(  # type: ignore[return-value]
        (leaf * torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype)).sum()
        for leaf in leaves(outputs)
    )


def assert_same_outputs(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
    for got, want in zip(leaves(actual), leaves(expected), strict=True):
        assert torch.equal(got, want)


def run(spec: ModelSpec, model: torch.nn.Module | None = None) -> Any:
    args, kwargs = pst.make_inputs(spec)
    return (model or pst.build(spec))(*args, **kwargs)


# --- models() draws models that work ---------------------------------------------------


@FEW
@given(pst.models())
def test_generated_models_run_forward_and_every_parameter_gets_a_gradient(spec: ModelSpec) -> None:
    model = pst.build(spec)
    outputs = run(spec, model)
    for leaf in leaves(outputs):
        assert leaf.shape[0] == spec.batch and torch.isfinite(leaf).all()
    random_projection(outputs).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), name


@FEW
@given(pst.models())
def test_generated_models_trace_with_missing_kwargs_specialised_to_none(spec: ModelSpec) -> None:
    model = pst.build(spec)
    missing = {i.name: None for i in spec.inputs if i.role == "kwarg" and not i.passed}
    # a copy: a running-mean layer updates its buffer, and each side must start from the same state
    traced = torch.fx.symbolic_trace(copy.deepcopy(model), concrete_args=missing or None)
    args, kwargs = pst.make_inputs(spec)
    assert_same_outputs(traced(*args, **kwargs), model(*args, **kwargs))


@FEW
@given(pst.models(features=["linear", "kwarg_default", "multi_output"]))
def test_generated_models_trace_with_optional_kwargs_passed(spec: ModelSpec) -> None:
    all_passed = dataclasses.replace(
        spec, inputs=tuple(dataclasses.replace(i, passed=True) for i in spec.inputs)
    )
    model = pst.build(all_passed)
    traced = torch.fx.symbolic_trace(model)
    args, kwargs = pst.make_inputs(all_passed)
    assert_same_outputs(traced(*args, **kwargs), model(*args, **kwargs))


@FEW
@given(pst.models())
def test_build_and_make_inputs_are_deterministic_and_leave_the_global_rng_alone(
    spec: ModelSpec,
) -> None:
    rng_before = torch.get_rng_state()
    first, second = pst.build(spec), pst.build(spec)
    (args1, kwargs1), (args2, kwargs2) = pst.make_inputs(spec), pst.make_inputs(spec)
    assert torch.equal(torch.get_rng_state(), rng_before)
    state1, state2 = first.state_dict(), second.state_dict()
    assert list(state1) == list(state2)
    assert all(torch.equal(state1[name], state2[name]) for name in state1)
    assert all(torch.equal(a, b) for a, b in zip(args1, args2, strict=True))
    assert kwargs1.keys() == kwargs2.keys()
    assert all(torch.equal(kwargs1[name], kwargs2[name]) for name in kwargs1)


@FEW
@given(pst.models())
def test_to_source_rebuilds_identical_parameters_inputs_and_outputs(spec: ModelSpec) -> None:
    namespace: dict[str, Any] = {"__name__": "repro"}
    exec(compile(pst.to_source(spec), "<to_source>", "exec"), namespace)
    model, rebuilt = pst.build(spec), namespace["make_model"]()
    assert list(rebuilt.state_dict()) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    for dtype in (torch.float32, torch.float64):
        args, kwargs = pst.make_inputs(spec, dtype)
        args_again, kwargs_again = namespace["make_inputs"](dtype)
        assert all(torch.equal(a, b) for a, b in zip(args, args_again, strict=True))
        assert kwargs.keys() == kwargs_again.keys()
        assert all(torch.equal(kwargs[name], kwargs_again[name]) for name in kwargs)
    assert_same_outputs(run(spec, rebuilt), run(spec, model))


@FEW
@given(pst.models())
def test_each_layer_is_the_submodule_named_by_its_index(spec: ModelSpec) -> None:
    model = pst.build(spec)
    assert [name for name, _ in model.named_children()] == list(spec.layer_names)


@FEW
@given(pst.models(features=["linear", "embedding", "tied", "activation"]))
def test_tied_layers_hold_the_owners_parameter_object(spec: ModelSpec) -> None:
    model = pst.build(spec)
    for index, layer in enumerate(spec.layers):
        if layer.kind == "tied":
            owner = model.get_submodule(f"l{layer.tied_to}")
            assert model.get_submodule(f"l{index}").weight is owner.weight


@FEW
@given(pst.models(min_layers=2, max_layers=3, min_width=3, max_width=5, batch=2))
def test_models_respect_the_bounds_given(spec: ModelSpec) -> None:
    assert 2 <= len(spec.layers) <= 3 and spec.batch == 2
    widths = [i.width for i in spec.inputs]
    widths += [layer.width for layer in spec.layers if layer.kind != "concat"]
    assert all(3 <= width <= 5 for width in widths), spec


@FEW
@given(pst.models(features=["layernorm", "concat", "tied", "dict_output"]))
def test_models_use_only_the_features_allowed_and_what_they_bring(spec: ModelSpec) -> None:
    assert pst.features(spec) <= {"layernorm", "concat", "linear", "tied", "dict_output"}


def test_every_feature_appears_within_200_draws() -> None:
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(pst.models(features=pst.FEATURES))  # dropout only when named
    def collect(spec: ModelSpec) -> None:
        seen.update(pst.features(spec))

    collect()
    assert sorted(set(pst.FEATURES) - seen) == []


def test_the_simplest_model_is_one_linear_layer_of_min_width() -> None:
    simplest = find(pst.models(), lambda spec: True,
                    settings=settings(database=None, derandomize=True))
    assert simplest == ModelSpec(
        inputs=(InputSpec("x", "x", 2),),
        layers=(LayerSpec("linear", (-1,), 2, bias=False),),
        outputs=OutputSpec("single", (0,)),
        batch=4,
        seed=0,
    )


@pytest.mark.slow
def test_a_tied_model_shrinks_to_a_linear_and_its_tied_twin() -> None:
    smallest = find(pst.models(), lambda spec: "tied" in pst.features(spec),
                    settings=settings(database=None, max_examples=1000, derandomize=True))
    assert smallest.layers == (
        LayerSpec("linear", (-1,), 2, bias=False),
        LayerSpec("tied", (0,), 2, tied_to=0, bias=False),
    )


# --- the hand-written spec using (nearly) everything -----------------------------------


def test_features_names_every_feature_a_spec_uses() -> None:
    assert pst.features(ALL_BUT_TUPLE) == set(pst.FEATURES) - {"multi_output", *pst.RANDOM_FEATURES}
    dropped = dataclasses.replace(ALL_BUT_TUPLE, layers=(*ALL_BUT_TUPLE.layers, LayerSpec("dropout", (17,), 5)),
                                  outputs=OutputSpec("dict", (18, 4, 0)))
    assert "dropout" in pst.features(dropped)
    single = dataclasses.replace(ALL_BUT_TUPLE, outputs=OutputSpec("tuple", (17,)))
    assert "multi_output" in pst.features(single)


def test_named_parameters_list_a_tied_weight_once_under_its_owner() -> None:
    model = pst.build(ALL_BUT_TUPLE)
    names = [name for name, _ in model.named_parameters()]
    assert "l0.weight" in names and "l11.weight" not in names and "l12.weight" not in names
    weight = {name: module.weight for name, module in model.named_children()
              if hasattr(module, "weight")}
    assert weight["l11"] is weight["l0"] is weight["l12"]
    assert weight["l13"] is weight["l3"]
    assert "l6.scale" in dict(model.named_buffers())


def test_a_built_model_pickles_and_deep_copies_like_any_module() -> None:
    model = pst.build(ALL_BUT_TUPLE).double()
    factory = pickle.loads(pickle.dumps(functools.partial(pst.build, ALL_BUT_TUPLE)))
    args, kwargs = pst.make_inputs(ALL_BUT_TUPLE, torch.float64)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), factory().double()):
        assert type(clone) is type(model)
        assert type(clone).spec == ALL_BUT_TUPLE  # type: ignore[attr-defined]
        weight = dict(clone.named_parameters())["l0.weight"]
        assert weight.dtype == torch.float64 and weight is not model.get_parameter("l0.weight")
        assert clone.get_submodule("l11").weight is weight
        # each from the same state: the running-mean layer updates its buffer on every call
        assert_same_outputs(clone(*args, **kwargs), copy.deepcopy(model)(*args, **kwargs))


def test_a_missing_optional_kwarg_is_skipped_and_a_passed_one_is_added() -> None:
    model = pst.build(ALL_BUT_TUPLE)
    args, kwargs = pst.make_inputs(ALL_BUT_TUPLE)
    assert sorted(kwargs) == ["k0", "s0"] and args[1].dtype == torch.int64 and kwargs["s0"].shape == (5,)
    assert [k for k in range(len(ALL_BUT_TUPLE.layers)) if not ALL_BUT_TUPLE.computes(k)] == [10]
    def outputs(**more: torch.Tensor) -> dict[str, torch.Tensor]:
        return copy.deepcopy(model)(*args, **kwargs, **more)  # the running mean starts afresh each time

    without, with_zero, with_one = outputs(), outputs(k1=torch.zeros(3, 6)), outputs(k1=torch.ones(3, 6))
    assert torch.equal(without["h17"], with_zero["h17"])
    assert not torch.equal(without["h17"], with_one["h17"])


def test_to_source_runs_as_a_script_that_imports_only_torch(tmp_path: Any) -> None:
    script = tmp_path / "repro.py"
    script.write_text(pst.to_source(ALL_BUT_TUPLE))
    assert re.findall(r"^(?:import|from) .*$", script.read_text(), re.M) == ["import torch"]
    done = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'h17': tensor(" in done.stdout


def test_to_source_of_a_small_model_reads_as_plain_torch() -> None:
    spec = ModelSpec(
        inputs=(InputSpec("x", "x", 3),),
        layers=(LayerSpec("linear", (-1,), 2), LayerSpec("activation", (0,), 2, op="relu")),
        outputs=OutputSpec("tuple", (1, 0)),
        batch=2,
        seed=5,
    )
    source = pst.to_source(spec)
    expected_tail = '''\
class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.utils.skip_init(torch.nn.Linear, 3, 2, bias=True)
        self.l1 = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h0 = self.l0(x)
        h1 = self.l1(h0)
        return (h1, h0)


def make_model() -> Model:
    model = Model()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.l0.weight.copy_(uniform_(g, (2, 3), 0.0, 0.5773502691896258))
        model.l0.bias.copy_(uniform_(g, (2,), 0.0, 0.5773502691896258))
    return model


def make_inputs(
    dtype: torch.dtype = torch.float32,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn((2, 3), generator=g).to(dtype)
    return (x,), {}


if __name__ == "__main__":
    args, kwargs = make_inputs()
    print(make_model()(*args, **kwargs))
'''
    assert source.endswith(expected_tail)
    assert source.startswith('"""A model generated by pipecheck.strategies (seed=5).\n\nModelSpec(')


# --- repr and arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (pst.models(), "models()"),
        (pst.models(max_layers=4), "models(max_layers=4)"),
        (pst.models(min_width=1, features=["linear"]), "models(min_width=1, features=['linear'])"),
        (pst.models(batch=8, min_layers=3), "models(min_layers=3, batch=8)"),
    ],
    ids=["defaults", "max_layers", "features", "keyword-order"],
)
def test_repr_reproduces_the_call(strategy: object, expected: str) -> None:
    assert repr(strategy) == expected


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"min_layers": 0}, "min_layers=0 must be at least 1"),
        ({"min_layers": 5, "max_layers": 3},
         "min_layers=5 is greater than max_layers=3; pass min_layers <= max_layers"),
        ({"max_layers": "8"}, "max_layers='8' must be an int"),
        ({"min_layers": True}, "min_layers=True must be an int"),
        ({"min_width": 0}, "min_width=0 must be at least 1"),
        ({"min_width": 9, "max_width": 4}, "min_width=9 is greater than max_width=4"),
        ({"batch": 0}, "batch=0 must be at least 1"),
        ({"features": "tied"}, "features='tied' must be a collection of feature names, "
                               "e.g. features=['tied']"),
        ({"features": ["linear", "bogus"]}, "features=['linear', 'bogus'] has unknown names "
                                            "['bogus']; choose from ['linear', "),
        ({"features": []}, "features=[] has no layer that fits at any position; add one of "
                           "['linear', 'layernorm', 'activation', 'buffer', 'kwarg', "
                           "'kwarg_default', 'function', 'running', 'replicated', 'dropout', "
                           "'functional_dropout', 'attention_dropout', 'channel_dropout', 'checkpointed_dropout']"),
        ({"features": ["residual", "multi_output"]}, "has no layer that fits at any position"),
        ({"features": ["tied", "layernorm"]}, "has 'tied' but no layer owning a weight to tie "
                                              "to; add 'linear' or 'embedding'"),
        ({"min_width": 0, "batch": -1}, "- min_width=0 must be at least 1\n"
                                        "- batch=-1 must be at least 1"),
    ],
    ids=["min_layers-zero", "layers-crossed", "max_layers-str", "min_layers-bool",
         "min_width-zero", "widths-crossed", "batch-zero", "features-str",
         "features-unknown", "features-empty", "features-no-base", "tied-without-owner",
         "all-problems-at-once"],
)
def test_invalid_arguments_raise_input_error_when_called(
    arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        pst.models(**arguments)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": (LayerSpec("linear", (0,), 2),)}, "sources=(0,) must be earlier values"),
        ({"layers": (LayerSpec("linear", (-1,), 3), LayerSpec("add", (0, -1), 3))},
         "reads values of different widths [3, 2]"),
        ({"layers": (LayerSpec("linear", (-1,), 3), LayerSpec("tied", (0,), 3, tied_to=0))},
         "maps width 3 to 3, but the tied weight (transpose=False) maps 2 to 3"),
        ({"layers": (LayerSpec("kwarg", (-1,), 2, input_name="k9"),)},
         "input_name='k9' names no input with role 'kwarg'"),
        ({"outputs": OutputSpec("single", (1,))}, "outputs.values=(1,) must be layer indices"),
        ({"inputs": (InputSpec("x", "x", 2), InputSpec("h0", "kwarg", 2))},
         "input name 'h0' is not usable as a forward argument"),
        ({"inputs": (InputSpec("x", "x", 2), InputSpec("k0", "kwarg", 2, passed=False))},
         "required kwarg 'k0' must be passed"),
    ],
    ids=["later-source", "add-widths", "tied-shape", "missing-kwarg", "missing-output",
         "reserved-name", "required-not-passed"],
)
def test_inconsistent_model_specs_are_refused(change: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {
        "inputs": (InputSpec("x", "x", 2),),
        "layers": (LayerSpec("linear", (-1,), 2),),
        "outputs": OutputSpec("single", (0,)),
        "batch": 4,
        "seed": 0,
    }
    with pytest.raises(InputError, match=re.escape(message)):
        ModelSpec(**{**fields, **change})


def test_make_inputs_refuses_a_non_float_dtype() -> None:
    with pytest.raises(InputError, match=re.escape("make_inputs(dtype=torch.int32)")):
        pst.make_inputs(ALL_BUT_TUPLE, torch.int32)
