"""Ranks build only their own stages, with the driver's values (pipecheck._split.stage_build): on a
rank the other stages stay on meta; wherever that cannot be done safely, the rank builds the whole
model as before, and the check passes either way."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import _stage_models as models
import pytest
import torch
import torch.nn as nn
from _training_models import make_tied_lm, mean_ce, sgd, tokens

import pipecheck as pc

# private: the driver's plan and file, and the rank's build, as a distributed step makes them
from pipecheck._runners.base import stage_state_on
from pipecheck._runners.job import Job
from pipecheck._runners.runtime.driver import plan_schedule, step_spec
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.stage_build import (
    STATE_PREFIX,
    held_tensors,
    split_own_stages,
    write_stage_state,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _x(factory) -> torch.Tensor:
    shape = (4, 3, models.D) if factory in (models.make_lstm, models.make_lstm_with_a_list) else (4, models.D)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def _held(world, make, n_microbatches: int = 2, **job_args) -> list[dict]:
    """Every rank's report of what it holds after building its split for one step of ``make``'s model."""
    job = Job(model=ModelFactory(make), args=(_x(make),), n_microbatches=n_microbatches, world=world, **job_args)
    pipe = job.structure()
    spec = step_spec(job, plan_schedule(job, pipe), pipe)
    with stage_state_on(world, job, pipe, spec.recipe) as state:
        assert state is not None
        return world.run(models.held_on_rank, dataclasses.replace(spec, state=state))


def _stage_bytes(make, stage: int) -> int:
    pipe = pc.split(ModelFactory(make)(), (_x(make),))
    return sum(t.nbytes for t in {id(t): t for _, _, t in held_tensors(pipe.stages[stage].module)}.values())


def test_a_rank_holds_only_its_own_stages(pipecheck_world):
    reports = _held(pipecheck_world(4), models.make_four_stages)
    for rank, report in enumerate(reports):
        assert report["own"] == [rank]
        assert report["devices"] == {s: ["cpu" if s == rank else "meta"] for s in range(4)}
        assert report["bytes"] == _stage_bytes(models.make_four_stages, rank)


def test_a_rank_with_two_stages_holds_one_tensor_of_a_weight_they_share(pipecheck_world):
    reports = _held(pipecheck_world(2), models.make_tied_ends, schedule="interleaved", stages_per_rank=2)
    assert [r["own"] for r in reports] == [[0, 2], [1, 3]]
    assert reports[0]["devices"] == {0: ["cpu"], 1: ["meta"], 2: ["cpu"], 3: ["meta"]}
    assert reports[0]["param_objects"]["emb.weight"] == 1 and "emb.weight" in reports[1]["param_objects"]


@pytest.mark.parametrize("make,whole_on", [(models.make_item_in_init, {0, 1, 2, 3}),
                                            (models.make_lstm_with_a_list, {1})],
                         ids=["factory-raises-under-meta", "tensor-left-on-meta"])
def test_a_model_that_cannot_be_built_in_part_is_built_whole_and_passes(pipecheck_world, make, whole_on):
    """Decided on each rank: the LSTM's list is on stage 1; rank 0 builds its stage alone."""
    world = pipecheck_world(len(pc.split(ModelFactory(make)(), (_x(make),)).stages))
    for rank, report in enumerate(_held(world, make)):
        whole = all(devices == ["cpu"] for devices in report["devices"].values())  # the whole model, as before
        assert whole == (rank in whole_on)
    assert pc.assert_equivalent(make, (_x(make),), runner="distributed", n_microbatches=2, world=world).ok


def test_a_users_module_is_copied_whole_as_before(pipecheck_world):
    world = pipecheck_world(4)
    module = models.make_four_stages()
    job = Job(model=ModelFactory(module), args=(_x(models.make_four_stages),), n_microbatches=2, world=world)
    pipe = job.structure()
    with stage_state_on(world, job, pipe, pipe.recipe.dumps()) as state:
        assert state is None  # nothing written: every rank deep-copies the module
    assert pc.assert_equivalent(module, (_x(models.make_four_stages),), runner="distributed", n_microbatches=2,
                                world=world).ok


def test_an_lstm_stage_is_built_alone(pipecheck_world):
    """An RNN keeps a list of its weights: they are assigned as its own code assigns them."""
    world = pipecheck_world(2)
    assert [r["devices"] for r in _held(world, models.make_lstm)] == [{0: ["cpu"], 1: ["meta"]},
                                                                       {0: ["meta"], 1: ["cpu"]}]
    assert pc.assert_equivalent(models.make_lstm, (_x(models.make_lstm),), runner="distributed", n_microbatches=2,
                                world=world).ok


def test_every_rank_runs_the_drivers_weights(pipecheck_world):
    """A factory whose weights differ from process to process: built alone, each stage holds the driver's,
    so the pipeline is the model eager ran (built whole on each rank, it was not)."""
    x = _x(models.make_pid_weights)
    report = pc.assert_equivalent(models.make_pid_weights, (x,), runner="distributed", n_microbatches=2,
                                  world=pipecheck_world(4))
    assert report.ok


def test_buffers_a_non_persistent_buffer_and_a_constant_match_eager(pipecheck_world):
    """BatchNorm's running statistics (updated by the step), a rotary-style non-persistent buffer and a
    plain tensor attribute the graph reads, on stages built alone."""
    report = pc.assert_equivalent(models.make_four_stages, (_x(models.make_four_stages),), runner="distributed",
                                  n_microbatches=2, world=pipecheck_world(4))
    assert report.ok
    assert {row.name for row in report.rows if row.kind == "buffers"} >= {"buffer norm.running_mean",
                                                                          "buffer norm.running_var"}


def test_a_weight_tied_across_ranks_gets_the_full_gradient(pipecheck_world):
    report = pc.assert_equivalent(models.make_tied_ends, (_x(models.make_tied_ends),), runner="distributed",
                                  n_microbatches=2, world=pipecheck_world(4))
    names = {row.name for row in report.rows}
    assert report.ok and {"grad emb.weight (replica in stage 0)", "grad emb.weight (replica in stage 3)"} <= names


def test_a_training_check_runs_on_stages_built_alone(pipecheck_world):
    """Two optimizer steps of a model whose embedding is tied to its head across the two ranks."""
    x, y = tokens()
    report = pc.assert_equivalent(make_tied_lm, (x,), runner="distributed", n_microbatches=2, loss_fn=mean_ce,
                                  target=y, steps=2, optimizer=sgd, world=pipecheck_world(2))
    assert report.ok and report.training


def test_a_training_check_trains_the_drivers_weights(pipecheck_world):
    """Each rank starts its training from the driver's weights, not its own build's (which differ here)."""
    report = pc.assert_equivalent(models.make_pid_weights, (_x(models.make_pid_weights),), runner="distributed",
                                  n_microbatches=2, steps=2, optimizer=sgd, world=pipecheck_world(4))
    assert report.ok and report.training


def test_the_drivers_file_is_removed_after_the_run_and_on_failure(tmp_path):
    class Folder:  # a World's folder, here a test's own
        def folder(self) -> str:
            return str(tmp_path)

    job = Job(model=ModelFactory(models.make_four_stages), args=(_x(models.make_four_stages),))
    pipe = job.structure()
    with stage_state_on(Folder(), job, pipe, pipe.recipe.dumps()) as state:
        assert state is not None and Path(state).name.startswith(STATE_PREFIX) and os.path.exists(state)
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="a rank failed"), stage_state_on(Folder(), job, pipe,
                                                                            pipe.recipe.dumps()) as state:
        raise RuntimeError("a rank failed")
    assert not list(tmp_path.iterdir())


def _own_split(tmp_path, make, stages, tamper=None):
    """``make``'s model cut as the driver cuts it, rebuilt with only ``stages`` from the driver's file
    (``tamper(state)`` changing that file first)."""
    factory = ModelFactory(make)
    x = _x(make)
    pipe = pc.split(factory(), (x,))
    path = write_stage_state(pipe, str(tmp_path))
    if tamper is not None:
        state = torch.load(path, weights_only=True)
        tamper(state)
        torch.save(state, path)
    return pipe, split_own_stages(torch.device("cpu"), factory, pipe.recipe.dumps(), (x,), {}, frozenset(stages),
                                  path)


def test_a_stage_built_alone_holds_the_drivers_values(tmp_path):
    driver, own = _own_split(tmp_path, models.make_pid_weights, {1, 2})
    for s in (1, 2):
        theirs = {name: t for name, _, t in held_tensors(driver.stages[s].module)}
        for name, _, mine in held_tensors(own.stages[s].module):
            assert torch.equal(mine, theirs[name]) and mine.untyped_storage().data_ptr() != \
                theirs[name].untyped_storage().data_ptr()
            assert type(mine) is type(theirs[name]) and mine.requires_grad == theirs[name].requires_grad


def _drop(key):
    return lambda state: state.pop(key)


def _reshape(key):
    return lambda state: state.__setitem__(key, torch.zeros(1))


def _recast(key):
    return lambda state: state.__setitem__(key, state[key].double())


def _untie(state):
    state["3:emb.weight"] = state["3:emb.weight"].clone()


@pytest.mark.parametrize("make,stages,tamper", [
    pytest.param(models.make_four_stages, {1}, _drop("1:rotary.inv_freq"), id="non-persistent-buffer-missing"),
    pytest.param(models.make_four_stages, {2}, _drop("2:scaled.scale"), id="constant-missing"),
    pytest.param(models.make_four_stages, {0}, _reshape("0:inp.weight"), id="shape-differs"),
    pytest.param(models.make_four_stages, {0}, _recast("0:norm.running_mean"), id="dtype-differs"),
    pytest.param(models.make_tied_ends, {0, 3}, _untie, id="tied-here-not-on-the-driver"),
    pytest.param(models.make_tied_ends, {1, 2}, lambda state: state.__setitem__("2:b.weight", state["1:a.weight"]),
                 id="tied-on-the-driver-not-here"),
])
def test_a_driver_file_that_does_not_fit_builds_the_whole_model(tmp_path, make, stages, tamper):
    assert _own_split(tmp_path, make, stages, tamper)[1] is None


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(models.D)
        self.out = nn.Linear(models.D, models.D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        pc.pipe_split()
        return self.out(h)


def make_lazy() -> Lazy:
    return Lazy()  # its first layer's shape unknown until a forward


@pytest.mark.parametrize("factory", [
    pytest.param(ModelFactory(models.make_four_stages()), id="a-users-module"),
    pytest.param(ModelFactory(models.make_item_in_init), id="raises-under-meta"),
    pytest.param(ModelFactory(make_lazy), id="lazy-module"),
    pytest.param(models.make_four_stages, id="not-a-model-factory"),
])
def test_a_model_that_cannot_be_built_alone_is_refused_here(tmp_path, factory):
    x = _x(models.make_four_stages)
    pipe = pc.split(ModelFactory(models.make_four_stages)(), (x,))
    path = write_stage_state(pipe, str(tmp_path))
    assert path is not None
    assert split_own_stages(torch.device("cpu"), factory, pipe.recipe.dumps(), (x,), {}, frozenset({0}), path) is None


def test_a_driver_whose_split_holds_a_lazy_parameter_writes_no_file(tmp_path):
    pipe = pc.split(make_lazy(), (torch.zeros(2, models.D),))
    assert write_stage_state(pipe, str(tmp_path)) is None and not list(tmp_path.iterdir())


def test_a_file_that_cannot_be_written_leaves_the_ranks_building_whole(tmp_path):
    pipe = pc.split(models.make_four_stages(), (_x(models.make_four_stages),))
    assert write_stage_state(pipe, str(tmp_path / "gone")) is None  # a folder removed (its World stopped), a full disk
