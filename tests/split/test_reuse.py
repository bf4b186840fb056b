"""Later checks of the same model reuse its trace; anything that could change the graph traces again."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
import pipecheck._split.pipe as pipe_module
from pipecheck import fixtures
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.reuse import forget_splits, split_reusing


class Traces:
    """Counts the traces made while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = pipe_module.trace

        def counted(*args: object, **kwargs: object) -> object:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(pipe_module, "trace", counted)


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Traces:
    forget_splits()
    yield Traces(monkeypatch)
    forget_splits()


def _split(factory: ModelFactory, args: tuple, kwargs: dict, **cut: object) -> pc.Pipe:
    return split_reusing(factory, factory(), args, kwargs, split_spec=cut.get("split_spec"), policy=cut.get("policy"),
                         tracer=str(cut.get("tracer", "auto")))


def test_a_second_split_of_the_same_model_reuses_the_trace(traces: Traces) -> None:
    entry = fixtures.get("tiny_gpt")
    args, kwargs = entry.inputs()
    factory = ModelFactory(entry.factory("spec"), seed=0)
    first = _split(factory, args, kwargs, **entry.cut("spec"), tracer="export")
    second = _split(ModelFactory(entry.factory("spec"), seed=0), args, kwargs, **entry.cut("spec"), tracer="export")
    assert traces.count == 1
    assert str(second) == str(first)
    assert [s.module.code for s in second.stages] == [s.module.code for s in first.stages]
    # the second split's stages hold its own model's parameters, not the first's
    assert not {id(p) for p in second.stage_module(0).parameters()} & {id(p) for p in first.stage_module(0).parameters()}


@pytest.mark.parametrize("change", ["inputs' batch", "inputs' dtype", "split_spec", "tracer", "factory",
                                    "seed", "eval mode", "frozen parameter", "patched forward"])
def test_anything_that_could_change_the_graph_traces_again(change: str, traces: Traces,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    entry = fixtures.get("mlp")
    (x,), kwargs = entry.inputs()
    cut = {"split_spec": {"layers.1": pc.SplitPoint.BEGINNING}, "tracer": "fx"}
    _split(ModelFactory(entry.factory("spec"), seed=0), (x,), kwargs, **cut)
    factory = ModelFactory(entry.factory("spec"), seed=0)
    if change == "inputs' batch":
        x = x[:4]
    elif change == "inputs' dtype":
        factory, x = ModelFactory(entry.factory("spec"), seed=0, dtype=torch.float64), x.double()
    elif change == "split_spec":
        cut["split_spec"] = {"layers.2": pc.SplitPoint.BEGINNING}
    elif change == "tracer":
        cut["tracer"] = "export"
    elif change == "factory":  # another function building a model of the same structure
        factory = ModelFactory(functools.partial(_built_by, entry.factory("spec")), seed=0)
    elif change == "seed":
        factory = ModelFactory(entry.factory("spec"), seed=1)
    elif change == "eval mode":
        factory = ModelFactory(functools.partial(_in_eval, entry.factory("spec")), seed=0)
    elif change == "frozen parameter":
        factory = ModelFactory(functools.partial(_frozen_first, entry.factory("spec")), seed=0)
    elif change == "patched forward":  # a bug planted in the model's class, as a test might
        block = type(factory().layers[0])
        monkeypatch.setattr(block, "forward", lambda self, h: self.fc(h).relu() * 2)
    _split(factory, (x,), kwargs, **cut)
    assert traces.count == 2


def _built_by(make: functools.partial) -> nn.Module:
    return make()


def _in_eval(make: functools.partial) -> nn.Module:
    return make().eval()


def _frozen_first(make: functools.partial) -> nn.Module:
    model = make()
    next(model.parameters()).requires_grad_(False)
    return model


def test_a_module_or_a_lambda_is_traced_every_time(traces: Traces) -> None:
    entry = fixtures.get("mlp")
    args, kwargs = entry.inputs()
    module = entry.factory("markers")()
    for model in (module, module, lambda: entry.factory("markers")(), lambda: entry.factory("markers")()):
        _split(ModelFactory(model, seed=0), args, kwargs, tracer="fx")
    assert traces.count == 4


def test_checks_of_one_model_trace_it_once(traces: Traces) -> None:
    entry = fixtures.get("tiny_gpt")
    args, kwargs = entry.inputs()
    reports = [pc.assert_equivalent(entry.factory("spec"), args, kwargs, runner="reference", n_microbatches=2,
                                    loss_fn=entry.loss_fn, target=entry.target(), **entry.cut("spec"))
               for _ in range(2)]
    assert traces.count == 1
    assert reports[0].rows == reports[1].rows
