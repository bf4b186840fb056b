"""Later checks of the same model reuse its trace; anything that could change the graph traces again."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
import pipecheck._split.pipe as pipe_module
import pipecheck._split.reuse as reuse
from pipecheck import fixtures
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.reuse import forget_splits, split_reusing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stand-in models
import _odd_models  # noqa: E402


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
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    forget_splits()
    yield Traces(monkeypatch)
    forget_splits()


def _split(factory: ModelFactory, args: tuple, kwargs: dict, **cut: object) -> pc.Pipe:
    return split_reusing(factory, factory(), args, kwargs, split_spec=cut.get("split_spec"), policy=cut.get("policy"),
                         tracer=str(cut.get("tracer", "auto")), hits=[])


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


@pytest.mark.parametrize("change", ["nothing", "inputs' batch", "inputs' dtype", "split_spec", "tracer", "factory",
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
    assert traces.count == (1 if change == "nothing" else 2)


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


SCALE = 1.0  # read by Helped.act: a global forward depends on that no key can see


class Helped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) * SCALE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


@pytest.mark.parametrize("change", ["module global", "helper method"])
def test_what_forward_reads_is_in_the_key_so_a_change_traces_afresh(change: str, traces: Traces,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper method or a global forward reads changed between two checks: another key, a fresh trace, before
    any runner runs (a stale graph would fail every gradient)."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    check = functools.partial(pc.assert_equivalent, Helped, (x,), split_spec={"b": pc.SplitPoint.BEGINNING},
                              runner="reference", n_microbatches=2, tracer="fx")
    check()
    if change == "module global":
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    else:
        monkeypatch.setattr(Helped, "act", lambda self, h: torch.sigmoid(h))
    check()
    assert traces.count == 2


SETTINGS = {"scale": 1.0}  # read by Configured.forward, changed in place: no key sees that


class Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * SETTINGS["scale"])


def test_a_stale_graph_the_key_cannot_see_is_named_and_the_runner_runs_once(traces: Traces,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A global dict changed in place between two checks: the reused graph computes the old forward, the check
    fails on it, traces again, sees another graph, and says so (a SplitError, not a mismatch), without running
    the runner a second time; the next check traces afresh and passes."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    runs = []

    def counted(job: pc.Job) -> pc.StepResult:
        runs.append(1)
        return pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                                   n_microbatches=job.n_microbatches)

    check = functools.partial(pc.assert_equivalent, Configured, (x,), split_spec={"b": pc.SplitPoint.BEGINNING},
                              n_microbatches=2, tracer="fx")
    check(runner="reference")
    monkeypatch.setitem(SETTINGS, "scale", 3.0)
    with pytest.raises(pc.SplitError) as info:
        check(runner=counted)  # the stale graph is found before the failure would be located (a second run)
    assert len(runs) == 1
    message = str(info.value)
    assert "tensors failed); traced again now" in message  # the failure it would have been, in brief
    assert "traced again now, the model gives another graph" in message and "not run a second time" in message
    assert "Fix: run the check again" in message
    assert traces.count == 2
    check(runner=counted)  # traced afresh
    assert len(runs) == 2 and traces.count == 3


class Masked(nn.Module):
    """A plain tensor attribute (not a buffer): a constant the graph holds, equal but not the same object
    in every trace."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.mask = torch.ones(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.mask)


@pytest.mark.parametrize("model", [Helped, Masked])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_correct_reuse_that_fails_is_not_run_again(model: type[nn.Module], tracer: str, traces: Traces,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that fails on a reused graph that still holds (a planted bug): one more trace, no rerun."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    runs = []

    def doubled_loss(job: pc.Job) -> pc.StepResult:
        runs.append(1)
        result = pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                                     n_microbatches=job.n_microbatches)
        return pc.StepResult(result.outputs, result.loss * 2, result.grads)

    held = []  # what each look at a reused graph found
    real = reuse.Hit.still_traced_the_same
    monkeypatch.setattr(reuse.Hit, "still_traced_the_same", lambda self: held.append(real(self)) or held[-1])
    check = functools.partial(pc.assert_equivalent, model, (x,), split_spec={"b": pc.SplitPoint.BEGINNING},
                              n_microbatches=2, tracer=tracer)
    check(runner="reference")
    with pytest.raises(pc.EquivalenceError):
        check(runner=doubled_loss)
    assert set(held) == {True}  # the failing check reused the graph, traced it again (once: below), found it the same
    assert traces.count == 2 and len(runs) >= 1
    rerun_free = len(runs)
    forget_splits()
    with pytest.raises(pc.EquivalenceError):
        check(runner=doubled_loss)
    assert len(runs) == 2 * rerun_free  # the same number of runner calls as a check that reused nothing


class Hooked(nn.Module):
    """A submodule with a forward of its own (as hook libraries wrap one), here a callable that does not hash."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.a.forward = Unhashable(self.a.forward)  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@dataclasses.dataclass
class Unhashable:
    call: object

    def __call__(self, *args: object) -> object:
        return self.call(*args)  # type: ignore[operator]


def test_a_model_with_its_own_forward_is_traced_every_time(traces: Traces) -> None:
    x = torch.randn(8, 8)
    for _ in range(2):
        _split(ModelFactory(Hooked, seed=0), (x,), {}, split_spec={"b": pc.SplitPoint.BEGINNING}, tracer="export")
    assert traces.count == 2


class Table(nn.Module):
    """A large tensor attribute that is not a buffer, read by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.table = torch.randn(512, 1024)  # 2 MiB

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + self.table[:1, :8])


def test_a_large_attribute_is_the_new_models_own_and_not_kept(traces: Traces) -> None:
    x = torch.randn(8, 8)
    cut = {"split_spec": {"b": pc.SplitPoint.BEGINNING}, "tracer": "export"}
    _split(ModelFactory(Table, seed=0), (x,), {}, **cut)
    assert reuse._recipes  # kept, without the large constant:
    assert not any(isinstance(v, torch.Tensor) and v.nbytes >= 1 << 20
                   for recipe in reuse._recipes.values() for v in recipe.constants.values())
    factory = ModelFactory(Table, seed=0)
    model = factory()
    pipe = split_reusing(factory, model, (x,), {}, split_spec=cut["split_spec"], policy=None, tracer="export",
                         hits=[])
    assert traces.count == 1
    assert any(getattr(stage.module, "table", None) is model.table for stage in pipe.stages)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_reused_split_of_a_model_with_a_custom_function_is_seen_to_hold(tracer: str, traces: Traces) -> None:
    """RecurrentGemma's trait (a custom autograd.Function): the second split reuses the first's trace, and
    tracing again finds the same graph (its recipe once did not pickle, so it never compared equal: a
    failing check would have been run twice, and the distributed ranks traced every time)."""
    x, cut = torch.rand(8, 8), {"split_spec": {"b": pc.SplitPoint.BEGINNING}, "tracer": tracer}
    _split(ModelFactory(_odd_models.GatedSqrt, seed=0), (x,), {}, **cut)
    hits: list[reuse.Hit] = []
    split_reusing(ModelFactory(_odd_models.GatedSqrt, seed=0), _odd_models.GatedSqrt(), (x,), {},
                  split_spec=cut["split_spec"], policy=None, tracer=tracer, hits=hits)
    assert traces.count == 1 and len(hits) == 1
    assert hits[0].recipe.dumps() is not None  # what the ranks are sent
    assert hits[0].still_traced_the_same() is True


class Reversed(nn.Module):
    """Reads its Function through a module of the user's (`_odd_models.Reverse`): forward's reads of a module's
    names that the module lacks (``self.b``) once made the reuse key fail, and no split was ever reused."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_odd_models.Reverse.apply(self.a(x)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_reused_graph_with_an_autograd_function_still_holds_and_a_failing_runner_runs_once(
        tracer: str, traces: Traces, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reused graph calls the Function by its class: traced again, it is found the same graph (it was
    once taken for a changed model, and the whole check ran again)."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    runs = []

    def broken(job: pc.Job) -> pc.StepResult:
        runs.append(1)
        raise RuntimeError("the engine broke")

    held = []
    real = reuse.Hit.still_traced_the_same
    monkeypatch.setattr(reuse.Hit, "still_traced_the_same", lambda self: held.append(real(self)) or held[-1])
    check = functools.partial(pc.assert_equivalent, Reversed, (x,), split_spec={"b": pc.SplitPoint.BEGINNING},
                              n_microbatches=2, tracer=tracer)
    check(runner="reference")
    with pytest.raises(pc.EngineError, match="the engine broke"):
        check(runner=broken)
    assert runs == [1]
    assert held == [True] and traces.count == 2  # the second check reused, failed, traced again: the same graph
    assert reuse._recipes  # still kept: the next check reuses it


def test_a_runner_that_times_out_on_a_reused_split_runs_once_and_nothing_is_traced_again(
        traces: Traces, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout is the runner's, whatever the graph: one timeout, not two, and no trace to ask."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    runs, release = [], threading.Event()

    def hangs(job: pc.Job) -> pc.StepResult:
        runs.append(1)
        release.wait(600)
        raise AssertionError("never resumed: the check stopped it")

    looked = []
    monkeypatch.setattr(reuse.Hit, "still_traced_the_same", lambda self: looked.append(1) or False)  # "changed"
    check = functools.partial(pc.assert_equivalent, Reversed, (x,), split_spec={"b": pc.SplitPoint.BEGINNING},
                              n_microbatches=2, tracer="fx")
    check(runner="reference")
    started = time.monotonic()
    try:
        with pytest.raises(pc.EngineError, match=r"did not finish within timeout=2 s") as info:
            check(runner=hangs, timeout=2)
    finally:
        release.set()
    assert time.monotonic() - started < 2 + 10  # one timeout (two would be 4 s of it)
    assert runs == [1] and looked == [] and traces.count == 1
    assert isinstance(info.value.__cause__, TimeoutError)
