"""The driver's split travels to the ranks as a recipe: they cut their own model along it, with no trace."""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
import pipecheck._split.pipe as pipe_module
from pipecheck import fixtures

# private: the distributed runner's step spec is what carries the recipe to the ranks
from pipecheck._runners.job import Job
from pipecheck._runners.runtime.driver import plan_schedule, step_spec
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import split_on
from pipecheck._split.recipe import SplitRecipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ranks import _world_jobs from there too
import _odd_models  # noqa: E402
import _world_jobs as jobs  # noqa: E402

CPU = torch.device("cpu")
CASES = [("mlp", "markers", "fx"), ("tiny_gpt", "spec", "fx"), ("encoder_decoder", "policy", "fx"),
         ("kwarg_default", "spec", "fx"), ("alias_reuse", "markers", "export"), ("buffers", "spec", "export"),
         ("dict_outputs", "spec", "export"), ("titan_lm", "spec", "export")]


def forbid_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a trace fails the test."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced again")

    monkeypatch.setattr(pipe_module, "trace", refuse)


def _driver_split(name: str, style: str, tracer: str) -> tuple[pc.Pipe, ModelFactory, tuple, dict]:
    entry = fixtures.get(name)
    args, kwargs = entry.inputs()
    factory = ModelFactory(entry.factory(style), seed=0)
    return pc.split(factory, args, kwargs, tracer=tracer, **entry.cut(style)), factory, args, kwargs


def _layout(pipe: pc.Pipe) -> tuple:
    return (str(pipe), pipe.edges, pipe.tied_groups, pipe.output_sources, pipe.input_names, pipe.out_spec,
            [(s.module.code, s.local_to_fqn, s.buffer_fqns) for s in pipe.stages])


@pytest.mark.parametrize(("name", "style", "tracer"), CASES)
def test_a_rank_cuts_its_model_along_the_drivers_graph(name: str, style: str, tracer: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    driver, factory, args, kwargs = _driver_split(name, style, tracer)
    forbid_tracing(monkeypatch)
    data = driver.recipe.dumps()
    assert data is not None
    built = []
    monkeypatch.setattr(SplitRecipe, "of", lambda *a, **k: built.append(a) or pytest.fail("recipe built again"))
    rank = split_on(CPU, factory, args, kwargs, split_spec=None, policy=None, tracer=tracer, recipe=data)
    assert not built  # the rank's Pipe keeps the recipe it was cut along: none is made from its graph
    assert _layout(rank) == _layout(driver)
    assert rank.bind_inputs(args, kwargs).keys() == driver.bind_inputs(args, kwargs).keys()
    # The rank's stages hold its own model's parameters, equal to the driver's (the factory is seeded).
    for mine, theirs in zip(rank.stages, driver.stages):
        for (local, p), (_, q) in zip(mine.module.named_parameters(), theirs.module.named_parameters()):
            assert p is not q and torch.equal(p, q), local


def test_the_recipe_keeps_what_an_fx_trace_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-tensor arguments and defaults fixed by the trace are still refused on the rank, by the same words."""
    driver, factory, args, kwargs = _driver_split("kwarg_default", "spec", "fx")
    forbid_tracing(monkeypatch)
    rank = split_on(CPU, factory, args, kwargs, split_spec=None, policy=None, tracer="fx",
                    recipe=driver.recipe.dumps())
    x = args[0]
    with pytest.raises(pc.InputError) as on_driver:
        driver.bind_inputs((x,), {"scale": 3.0})
    with pytest.raises(pc.InputError) as on_rank:
        rank.bind_inputs((x,), {"scale": 3.0})
    assert str(on_rank.value) == str(on_driver.value)
    assert "left to its default when traced" in str(on_rank.value)


def wrapped_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


torch.fx.wrap("wrapped_scale")  # fx keeps it as one call, and a stage's code says so (torchvision's stochastic_depth)


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(wrapped_scale(self.a(x)))


def test_a_wrapped_functions_call_keeps_its_wrap_in_the_stage_code(monkeypatch: pytest.MonkeyPatch) -> None:
    args, spec = (torch.randn(4, 4),), {"a": pc.SplitPoint.END}
    driver = pc.split(ModelFactory(Wrapped, seed=0), args, split_spec=spec, tracer="fx")
    assert "wrap(" in driver.stages[1].module.code
    forbid_tracing(monkeypatch)
    rank = split_on(CPU, ModelFactory(Wrapped, seed=0), args, None, split_spec=spec, policy=None, tracer="fx",
                    recipe=driver.recipe.dumps())
    assert _layout(rank) == _layout(driver)


class Constants(nn.Module):
    """Tensors forward reads that are not parameters or buffers: a plain attribute, and one made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.offset = torch.arange(4.0) / 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b((self.a(x) + self.offset) * torch.tensor([1.0, -2.0, 3.0, 0.5]))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_ranks_stages_hold_the_drivers_constants(tracer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args, spec = (torch.randn(6, 4),), {"b": pc.SplitPoint.BEGINNING}
    factory = ModelFactory(Constants, seed=0)
    driver = pc.split(factory, args, split_spec=spec, tracer=tracer)
    forbid_tracing(monkeypatch)
    rank = split_on(CPU, factory, args, None, split_spec=spec, policy=None, tracer=tracer,
                    recipe=driver.recipe.dumps())
    assert _layout(rank) == _layout(driver)
    # The same step, bit for bit: a constant carried wrongly (or read off the wrong model) changes it.
    ours, theirs = (pc.DetachExecutor(pipe).step(args, n_microbatches=2) for pipe in (driver, rank))
    assert torch.equal(ours.outputs, theirs.outputs)
    assert ours.grads.keys() == theirs.grads.keys() == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert all(torch.equal(ours.grads[k], theirs.grads[k]) for k in ours.grads)
    assert torch.allclose(theirs.outputs, factory()(*args), atol=1e-6)  # and both are the model's


def test_a_graph_that_does_not_pickle_is_traced_on_the_rank() -> None:
    calls: list[int] = []

    class Double(torch.autograd.Function):  # a local class: pickle cannot name it, and fx keeps it as one call
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    class Local(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return self.b(Double.apply(self.a(x)))

    model, x = Local(), torch.randn(4, 4)
    spec = {"b": pc.SplitPoint.BEGINNING}
    job = Job(model=model, args=(x,), split_spec=spec, tracer="fx", n_microbatches=2)
    pipe = job.structure()
    plan = step_spec(job, plan_schedule(job, pipe), pipe)
    assert plan.recipe is None  # what the runner sends: no recipe, so the rank traces
    before = len(calls)
    again = plan.split_on(CPU)
    assert len(calls) > before and str(again) == str(pipe)


def test_a_graph_naming_another_device_is_not_used_there() -> None:
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + torch.arange(4, device=x.device))

    pipe = pc.split(Positions(), (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING}, tracer="export")
    data = pipe.recipe.dumps()
    recipe = SplitRecipe.load(data, CPU)
    assert recipe is not None and recipe.devices == {CPU}
    assert SplitRecipe.load(data, torch.device("cuda", 1)) is None
    assert SplitRecipe.load(data, torch.device("meta")) is None


class Subgraphs(nn.Module):
    """A device named inside export's no_grad subgraph only, or by autocast's device type (a string)."""

    def __init__(self, block: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.block == "no_grad":
            with torch.no_grad():
                h = h + torch.ones(1, device="cpu")
        else:
            with torch.autocast("cpu", enabled=False):
                h = h * 2
        return self.b(h)


@pytest.mark.parametrize("block", ["no_grad", "autocast"])
def test_devices_inside_subgraphs_and_autocast_count(block: str) -> None:
    pipe = pc.split(Subgraphs(block), (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING},
                    tracer="export")
    top_level = {leaf for row in pipe.recipe.nodes for leaf in torch.utils._pytree.tree_leaves((row[3], row[4]))}
    assert not any(isinstance(leaf, torch.device) for leaf in top_level)  # what the first version looked at
    assert pipe.recipe.devices == {CPU}
    assert SplitRecipe.load(pipe.recipe.dumps(), torch.device("meta")) is None


def test_a_recipe_that_cannot_be_read_on_the_rank_is_traced_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator the graph calls and the rank does not know yet (a library the factory imports): trace."""
    import pipecheck._split.recipe as recipe_module

    driver, factory, args, kwargs = _driver_split("titan_lm", "spec", "export")
    data = driver.recipe.dumps()

    def unknown(namespace: str, name: str, overload: str) -> None:
        raise AttributeError(f"'_OpNamespace' '{namespace}' object has no attribute '{name}'")

    monkeypatch.setattr(recipe_module, "_op_overload", unknown)
    assert SplitRecipe.load(data, CPU) is None
    rank = split_on(CPU, factory, args, kwargs, tracer="export", recipe=data, **fixtures.get("titan_lm").cut("spec"),
                    policy=None)
    assert _layout(rank) == _layout(driver)


class Options:
    """A plain option object: no ``==`` of its own, so a copy is not equal to it."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class WithOptions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, options: Options) -> torch.Tensor:
        return self.b(self.a(x) * options.scale)


def test_non_tensor_arguments_that_arrive_as_copies_are_the_traced_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's arguments are unpickled copies of the driver's, and so are the recipe's: not a mismatch."""
    args = (torch.randn(4, 4), Options(2.0))
    spec = {"b": pc.SplitPoint.BEGINNING}
    driver = pc.split(ModelFactory(WithOptions, seed=0), args, split_spec=spec, tracer="fx")
    forbid_tracing(monkeypatch)
    copies = pickle.loads(pickle.dumps(args))
    rank = split_on(CPU, ModelFactory(WithOptions, seed=0), copies, None, split_spec=spec, policy=None, tracer="fx",
                    recipe=driver.recipe.dumps())
    assert rank.bind_inputs(copies).keys() == {"x"}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_graph_calling_an_importable_autograd_function_travels_by_its_class(tracer: str) -> None:
    import _odd_models

    pipe = pc.split(_odd_models.ReversedHangsOnRank1(), (torch.randn(4, 4),),
                    split_spec={"b": pc.SplitPoint.BEGINNING}, tracer=tracer)
    data = pipe.recipe.dumps()
    assert data is not None  # no rank traces the model again
    recipe = SplitRecipe.load(data, CPU)
    assert recipe is not None

    def calls(rows: Any) -> list[Any]:
        return [row[2] for row in rows if getattr(row[2], "autograd_function", None) is not None]

    assert calls(recipe.nodes) == calls(pipe.recipe.nodes) and len(calls(recipe.nodes)) == 1  # the same object


def test_the_recipe_names_torchs_operators_by_name() -> None:
    pipe, *_ = _driver_split("titan_lm", "spec", "export")
    _devices, payload = pickle.loads(pipe.recipe.dumps())
    assert b"_op_overload" in payload
    targets = {row[2] for row in pickle.loads(payload).nodes if row[0] == "call_function"}
    assert torch.ops.aten.embedding.default in targets


class _Globals(pickle.Unpickler):
    """An unpickler that lists the globals a payload names."""

    def __init__(self, payload: bytes) -> None:
        super().__init__(io.BytesIO(payload))
        self.named: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.named.add(f"{module}.{name}")
        return super().find_class(module, name)


def test_a_pytree_leaf_is_read_back_as_torchs_own_without_a_warning() -> None:
    """An exported graph's in/out specs hold leaves. Unpickled as they are, each is a new ``LeafSpec``: torch
    2.10 warns of that on every rank (a FutureWarning on the user's stderr, for every check)."""
    pipe, *_ = _driver_split("titan_lm", "spec", "export")
    data = pipe.recipe.dumps()
    _devices, payload = pickle.loads(data)
    reader = _Globals(payload)
    reader.load()
    assert "pipecheck._split.recipe._leaf_spec" in reader.named  # the graph has leaves
    assert not any(name.endswith("LeafSpec") for name in reader.named)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = SplitRecipe.load(data, CPU)
    assert recipe is not None


def test_ranks_of_a_world_cut_without_tracing(pipecheck_world) -> None:
    """What the distributed runner sends: every rank's split comes from the recipe, none traces."""
    entry = fixtures.get("tiny_gpt")
    args, kwargs = entry.inputs()
    factory = ModelFactory(entry.factory("spec"), seed=0)
    job = Job(model=factory, args=args, kwargs=kwargs, tracer="export", n_microbatches=2, **entry.cut("spec"))
    pipe = job.structure()
    spec = step_spec(job, plan_schedule(job, pipe), pipe)
    assert spec.recipe is not None
    expected = (str(pipe), [stage.module.code for stage in pipe.stages])
    assert pipecheck_world(2).run(jobs.split_without_tracing, spec)[:2] == [expected, expected]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_custom_functions_call_travels_in_the_recipe(tracer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RecurrentGemma's SqrtBoundDerivative: the graph calls the Function through a closure pickle cannot
    name, so the recipe did not pickle and every rank of every check traced the model again (5 s a warm
    check). The call travels as its class; the rank's stages run the Function's own backward."""
    factory, x = ModelFactory(_odd_models.GatedSqrt, seed=0), torch.rand(8, 8)
    driver = pc.split(factory, (x,), split_spec={"b": pc.SplitPoint.BEGINNING}, tracer=tracer)
    data = driver.recipe.dumps()
    assert data is not None
    forbid_tracing(monkeypatch)
    rank = split_on(CPU, factory, (x,), None, split_spec=None, policy=None, tracer=tracer, recipe=data)
    assert _layout(rank) == _layout(driver)
    assert "ClippedSqrt_apply" in rank.stage_module(0).code
    ours, theirs = (pc.DetachExecutor(pipe).step((x,), n_microbatches=2) for pipe in (rank, driver))
    assert all(torch.equal(ours.grads[k], theirs.grads[k]) for k in theirs.grads)
    plain = factory()
    (plain.b(plain.a(x) * torch.sqrt(torch.sigmoid(plain.a(x)) * 0.5))).sum().backward()  # autograd's sqrt
    assert not torch.allclose(ours.grads["a.weight"], plain.a.weight.grad)  # so the clipped backward ran


def test_ranks_of_a_world_cut_a_model_with_a_custom_function_without_tracing(pipecheck_world) -> None:
    factory = ModelFactory(_odd_models.GatedSqrt, seed=0)
    job = Job(model=factory, args=(torch.rand(8, 8),), split_spec={"b": pc.SplitPoint.BEGINNING}, tracer="export",
              n_microbatches=2)
    pipe = job.structure()
    spec = step_spec(job, plan_schedule(job, pipe), pipe)
    assert spec.recipe is not None
    expected = (str(pipe), [stage.module.code for stage in pipe.stages])
    assert pipecheck_world(2).run(jobs.split_without_tracing, spec)[:2] == [expected, expected]
