"""runner="torch": torch.distributed.pipelining on pipecheck's World, checked against eager.

torch runs the plain zoo models correctly; it cannot run skip connections across
more than one stage or kwargs consumed after stage 0 (EngineError with torch's
own message, rank and stage); it runs tied weights but never sums the replicas'
gradients, which the check reports as "tied parameter not synchronised".

Tests that make torch fail on a rank come last per world size: a rank failure
stops that World's processes, and the next test on it starts fresh ones.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _torch_findings import SKIP
from pipecheck.fixtures import get

import pipecheck as pc

# private: the command line's exit status and a rank's task call, for the torch runner's failures
from pipecheck._cli.main import main
from pipecheck._runners.torch_pipelining import driver as _torch_runner
from pipecheck._runners.torch_pipelining.driver import policy_module_cuts, torch_message
from pipecheck._runners.torch_pipelining.rank import _alias_table, stage_grads
from pipecheck.errors import RankError

N_MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _quiet_torch_export() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def check(world: pc.World, name: str, style: str | None = None, *, model: Any = None,
          **overrides: Any) -> pc.Report:
    entry = get(name)
    style = style or entry.cut_styles[0]
    args, kwargs = entry.inputs()
    settings = {"loss_fn": entry.loss_fn, "target": entry.target(), "n_microbatches": N_MICROBATCHES,
                **entry.cut(style), **overrides}
    return pc.assert_equivalent(entry.factory(style) if model is None else model, args, kwargs, runner="torch",
                                world=world, **settings)


# --- no World needed ------------------------------------------------------------------------------


def test_policy_cuts_become_module_split_points() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    pipe = pc.split(entry.factory("policy"), args, kwargs, **entry.cut("policy"))
    assert policy_module_cuts(pipe) == {"layers.1.fc": pc.SplitPoint.BEGINNING,
                                        "layers.2.fc": pc.SplitPoint.BEGINNING,
                                        "layers.3.fc": pc.SplitPoint.BEGINNING}


def test_policy_cut_torch_cannot_express_is_an_engine_error() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    pipe = pc.split(entry.factory("policy"), args, kwargs, tracer="export", **entry.cut("policy"))
    with pytest.raises(pc.EngineError, match="not supported by torch"):
        policy_module_cuts(pipe)


def test_torch_stage_parameter_names_map_back_to_original_fqns() -> None:
    from torch.distributed.pipelining import pipeline

    from pipecheck._runners.torch_pipelining.rank import _translate_markers

    model = get("alias_reuse").factory("markers")()
    names, by_id = _alias_table(model)
    (x,), _ = get("alias_reuse").inputs()
    pipe = pipeline(model, (x[:2],), {}, split_policy=_translate_markers(True))
    assert "shared@1" in {n.target for n in pipe.get_stage_module(2).graph.nodes}  # 2nd call, renamed
    seen: dict[int, set[str]] = {}
    for s in range(pipe.num_stages):
        module = pipe.get_stage_module(s)
        for param in module.parameters():
            param.grad = torch.ones_like(param)
        grads, unmapped = stage_grads(module, names, by_id)
        assert unmapped == []
        seen[s] = set(grads)
    assert {"proj.weight", "shared.fc.weight"} <= seen[0]
    assert {"proj.weight", "shared.fc.weight", "head.bias"} <= seen[2]  # head.weight is proj.weight


def test_torch_failure_message_is_the_wrapped_cause_with_torch_context() -> None:
    try:
        try:
            raise TypeError("forward() got an unexpected keyword argument 'bias'")
        except TypeError as cause:
            raise RuntimeError("\n    [Stage 0] failed to run forward:\n    args: ...") from cause
    except RuntimeError as err:
        error = RankError.from_exception(err, rank=0, stage=0, action="0F0")  # as it leaves the rank
    message, context = torch_message(error)
    assert message == "TypeError: forward() got an unexpected keyword argument 'bias'"
    assert context == "[Stage 0] failed to run forward"


def test_unknown_schedule_is_refused_before_any_rank_runs() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    with pytest.raises(pc.ScheduleError, match="unknown schedule"):
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="torch", schedule="zigzag", n_microbatches=4)


def test_targets_torch_cannot_chunk_travel_as_microbatch_indices() -> None:
    from pipecheck._runners.torch_pipelining.rank import (
        TorchStepError,
        TorchStepSpec,
        _LossOfMicrobatch,
        _torch_target,
    )

    target = {"w": torch.randn(8, 2), "unused": torch.zeros(())}  # a pytree with a 0-dim leaf
    sent, by_index = _torch_target(target, 4, torch.device("cpu"))
    assert by_index and torch.equal(sent, torch.arange(4))
    out_spec = torch.utils._pytree.tree_flatten({"w": torch.zeros(1)})[1]
    spec = TorchStepSpec(model=torch.nn.Identity, args=(), kwargs={},
                         loss_fn=lambda out, tgt: (out["w"] * tgt["w"]).sum(), target=target, n_microbatches=4,
                         schedule="1f1b", n_stages=1, module_cuts={}, keep_markers=True,
                         out_spec_json=torch.utils._pytree.treespec_dumps(out_spec), torch_class="Schedule1F1B",
                         stage_to_rank=(0,))
    chunks = pc.split_microbatches(target, 4, "target")
    loss = _LossOfMicrobatch(spec, target, by_index)
    output = torch.ones(2, 2)  # torch's last stage returns flat leaves; the loss sees the model's structure
    assert torch.equal(loss(output, sent.tensor_split(4)[2]), chunks[2]["w"].sum())
    tensor_target = torch.randn(8, 2)
    plain = _LossOfMicrobatch(dataclasses.replace(spec, target=tensor_target), tensor_target, False)
    with pytest.raises(TorchStepError, match="chunked the target differently"):
        plain(output, tensor_target[2:4])  # micro-batch 0 given micro-batch 1's chunk


# --- torch runs it right ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,style,schedule", [
    ("mlp", "markers", "1f1b"),
    ("mlp", "spec", "gpipe"),
    ("mlp", "policy", "1f1b"),
    ("mlp", "markers", "interleaved"),
    ("nested_spec", "spec", "1f1b"),
])
def test_torch_matches_eager_on_four_stage_models(pipecheck_world, name, style, schedule) -> None:
    report = check(pipecheck_world(4), name, style, schedule=schedule)
    assert report.ok and report.runner == "torch" and report.num_stages == 4


def test_torch_interleaved_two_stages_per_rank(pipecheck_world) -> None:
    assert check(pipecheck_world(2), "mlp", schedule="interleaved", stages_per_rank=2).ok


def test_torch_split_spec_leaves_the_users_module_alone(pipecheck_world) -> None:
    entry = get("mlp")
    model = entry.factory("spec")()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check(pipecheck_world(4), "mlp", "spec", model=model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_torch_does_not_scale_input_gradients(pipecheck_world) -> None:
    # torch's scale_grads divides parameter gradients by n_microbatches, never the gradients it
    # accumulates into the step's (full-batch) inputs: those come back n_microbatches times too large.
    entry = get("mlp")
    (x,), kwargs = entry.inputs()
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(), (x.requires_grad_(),), kwargs, runner="torch",
                             n_microbatches=N_MICROBATCHES, world=pipecheck_world(4))
    report = caught.value.report
    assert [row.name for row in report.failures] == ["grad input x"]
    assert report.row("grad input x").max_rel == pytest.approx(N_MICROBATCHES - 1, rel=1e-4)
    assert report.hints["grad input x"].startswith("gradient scaling: gradient is n_microbatches (=4) times too large")


# --- torch runs it, wrongly: tied weights -------------------------------------------------------------


@pytest.mark.parametrize("name,tensor,stages", [
    pytest.param("tiny_gpt", "grad tok_emb.weight", "0, 3", id="tiny_gpt"),
    pytest.param("alias_reuse", "grad proj.weight", "0, 2", id="alias_reuse"),
])
def test_torch_tied_weights_are_not_synchronised(pipecheck_world, name, tensor, stages) -> None:
    entry = get(name)
    with pytest.raises(pc.EquivalenceError) as caught:
        check(pipecheck_world(entry.num_stages), name)
    report = caught.value.report
    assert tensor in [row.name for row in report.failures]
    assert "tied parameter not synchronised" in report.hints[tensor]
    assert f"stages {stages} hold replicas" in report.hints[tensor]
    assert tensor in str(caught.value)


def test_buffers_model_passes_on_three_ranks(pipecheck_world) -> None:
    assert check(pipecheck_world(3), "buffers").ok


def test_outputs_of_a_middle_stage_are_an_engine_error_and_the_world_survives(pipecheck_world) -> None:
    world = pipecheck_world(3)
    check(world, "buffers")  # the world is up
    pids = world.pids
    with pytest.raises(pc.EngineError) as caught:
        check(world, "dict_outputs")
    lines = str(caught.value).splitlines()
    assert lines[0] == "torch returns only last-stage outputs; output['extra'][0] is stage 1's"
    assert lines[1].startswith("torch.distributed.pipelining failed on rank 0, stage 0, before running the schedule")
    assert world.pids == pids  # every rank refused before communicating: no restart


# --- torch cannot run it: EngineError with torch's message (these stop the World) ---------------------




@pytest.mark.parametrize("name,message,inside,rank", [
    pytest.param("kwarg_last", "TypeError: forward() got an unexpected keyword argument 'bias'",
                 " (inside torch: [Stage 0] failed to run forward)", 0, id="kwarg_last"),
    pytest.param("skip_one", SKIP, "", 0, id="skip_one"),
    pytest.param("long_skip", SKIP, "", 0, id="long_skip"),
    pytest.param("encoder_decoder", SKIP, "", 0, id="encoder_decoder"),
])
def test_what_torch_cannot_run_is_an_engine_error(pipecheck_world, name, message, inside, rank,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own failure mid-step, as it comes back from the ranks (pipecheck's refusal of it before
    any rank starts, tested below, is turned off here)."""
    # private: the up-front refusal, turned off to reach torch's own failure
    from pipecheck._runners.torch_pipelining import driver as torch_driver

    monkeypatch.setattr(torch_driver, "unrunnable_by_torch", lambda job, pipe: [])
    entry = get(name)
    with pytest.raises(pc.EngineError) as caught:
        check(pipecheck_world(entry.num_stages), name)
    err = caught.value
    lines = str(err).splitlines()
    assert lines[0] == message  # what `python -m pipecheck zoo` shows in the torch column
    assert lines[1].startswith(f"torch.distributed.pipelining failed on rank {rank}, stage 0, in schedule.step"
                               f"{inside}; schedule '1f1b'")
    assert (err.rank, err.stage, err.engine) == (rank, 0, "torch.distributed.pipelining")  # type: ignore[attr-defined]
    assert isinstance(err.__cause__, pc.WorldError)


@pytest.mark.parametrize("name,problem", [
    ("kwarg_last", "forward() got an unexpected keyword argument 'bias': torch's schedule.step gives keyword inputs "
                   "to stage 0's module, and 'bias' is read by stage(s) [2], not stage 0."),
    ("kwarg_default", "forward() got an unexpected keyword argument 'gate': "),
])
def test_what_torch_would_fail_on_mid_step_is_refused_before_any_rank_runs(pipecheck_world, name, problem) -> None:
    """Each would stop the World mid-step (the other ranks wait on the failing one): seconds lost to
    a restart, and a message about torch's internals. Refused up front instead, naming the keyword."""
    entry = get(name)
    world = pipecheck_world(entry.num_stages)
    check(world, "buffers")  # the world is up
    pids = world.pids
    with pytest.raises(pc.EngineError) as caught:
        check(world, name)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(problem), lines  # what `python -m pipecheck zoo` shows in the torch column
    assert lines[-1].endswith("refused before any rank started.")
    assert world.pids == pids


def test_ranks_sharing_a_gpu_are_refused_before_any_rank_runs() -> None:
    """gloo's send/recv cannot carry CUDA tensors, and torch hands them to it straight: refused up front,
    saying the rule (a GPU per rank), the placement seen and the ways out."""
    from types import SimpleNamespace

    entry = get("mlp")
    args, kwargs = entry.inputs()

    class SharedGpuWorld(SimpleNamespace):
        def run(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("no rank may start")

    world = SharedGpuWorld(world_size=4, device="cuda", properties=SimpleNamespace(
        gpus_shared=True, devices=("cuda:0",) * 4))
    with pytest.raises(pc.EngineError, match=r"needs one GPU per rank, and .* runs 4 ranks on 1 GPU\(s\) \(cuda:0\)"
                       ) as caught:
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="torch", n_microbatches=4, world=world)
    assert caught.value.engine == "torch.distributed.pipelining"
    assert "Fix: runner='distributed', which passes tensors between ranks on one GPU on the device" in str(caught.value)
    assert "or as many GPUs as ranks (4, NCCL)" in str(caught.value)


def test_a_cause_that_says_nothing_gives_way_to_the_one_that_does() -> None:
    """torch's Llama split fails deep in fx with a bare StopIteration; the message is a level up."""
    try:
        try:
            try:
                raise StopIteration
            except StopIteration as inner:
                raise RuntimeError("Expected positional argument for parameter unsqueeze_default, but one was "
                                   "not passed in!") from inner
        except RuntimeError as cause:
            raise RuntimeError("\n    [Stage 0] failed to run forward:\n    args: ...") from cause
    except RuntimeError as err:
        error = RankError.from_exception(err, rank=0, stage=0, action="0F0")
    message, context = torch_message(error)
    assert message == ("RuntimeError: Expected positional argument for parameter unsqueeze_default, but one was "
                       "not passed in!")
    assert context == "[Stage 0] failed to run forward"


# --- pipecheck's own adapter broken by a torch release ----------------------------------------------


def _with_a_schedule_class_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks look up a schedule class this torch does not have, as pipecheck's adapter would
    after torch renamed one: an AttributeError raised in pipecheck's own rank code."""
    real = _torch_runner.plan_torch_step
    monkeypatch.setattr(_torch_runner, "plan_torch_step", lambda job, pipe: dataclasses.replace(
        real(job, pipe), torch_class="ScheduleGoneInThisTorch"))


def test_an_api_missing_on_the_ranks_is_pipecheck_s_adapter_error_not_torch_s(pipecheck_world, monkeypatch):
    _with_a_schedule_class_torch_lacks(monkeypatch)
    with pytest.raises(pc.AdapterError) as caught:
        check(pipecheck_world(4), "mlp")
    message = str(caught.value)
    first = message.splitlines()[0]
    assert first.startswith("AttributeError: ") and "ScheduleGoneInThisTorch" in first, first
    assert "(in pipecheck's adapter for torch.distributed.pipelining, pipecheck/_runners/torch_pipelining/rank.py:" in first, first
    assert "This is pipecheck's error, not a finding about torch.distributed.pipelining" in message
    assert f"this is torch {torch.__version__}, one of them" in message and "this is pipecheck's bug" in message
    assert not isinstance(caught.value, pc.EngineError)
    assert (caught.value.engine, caught.value.cause.in_pipecheck) == ("torch.distributed.pipelining", True)


def test_the_zoo_exits_4_for_an_adapter_error_even_in_the_torch_column(pipecheck_world, monkeypatch, capsys):
    pipecheck_world(4)  # the shared World the columns run on
    _with_a_schedule_class_torch_lacks(monkeypatch)
    assert main(["zoo", "--models", "mlp", "--runners", "reference,torch"]) == 4
    assert "ERROR AdapterError: AttributeError: " in capsys.readouterr().out


def test_torch_s_own_failure_and_the_user_s_are_not_pipecheck_s() -> None:
    """Only an adapter's own line calling an engine's API is pipecheck's failure: not torch's or a
    model's code, not a user's object that lacks an attribute, not a job the ranks cannot import."""
    import pickle

    from pipecheck._runners.torch_pipelining.rank import stage_grads
    from pipecheck._world.worker import RankContext, run_call

    def in_pipecheck(call: Any, error: type[BaseException]) -> bool:
        with pytest.raises(error) as caught:
            call()
        return RankError.from_exception(caught.value, rank=0, stage=0, action=None).in_pipecheck

    class UserThing:  # a user's object reached from an adapter's line
        pass

    def torch_side() -> None:  # stands in for torch's or the model's code: not a pipecheck adapter
        raise AttributeError("'Tensor' object has no attribute 'foo'")

    assert not in_pipecheck(torch_side, AttributeError)
    assert not in_pipecheck(lambda: pc.split(None, ()), pc.PipecheckError)  # pipecheck's deliberate errors
    assert not in_pipecheck(lambda: stage_grads(UserThing(), {}, {}), AttributeError)  # type: ignore[arg-type]
    assert in_pipecheck(lambda: stage_grads(torch.nn, {}, {}), AttributeError)  # type: ignore[arg-type]
    gone = pickle.dumps(_world_jobs_pid_task())
    ctx = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    failed = run_call(ctx, 0, gone.replace(b"_world_jobs", b"_world_gone"))  # same length: a module the ranks lack
    assert not failed.error.in_pipecheck and failed.error.exc_type == "ModuleNotFoundError"  # type: ignore[union-attr]


def _world_jobs_pid_task() -> Any:
    from _world_jobs import pid

    from pipecheck._world.worker import TaskCall

    return TaskCall(pid, (), {})


def test_a_bare_assert_inside_torch_is_named_by_where_it_was_raised() -> None:
    """torch 2.10's fx interpreter fails Llama's outlined rotary embedding with a bare assert: the cell
    says where, not only 'AssertionError'."""
    def run_from() -> None:
        raise AssertionError  # what a bare `assert` raises outside pytest's rewriting

    try:
        run_from()
    except AssertionError as err:
        error = RankError.from_exception(err, rank=0, stage=None, action=None)
    message, context = torch_message(error)
    assert message.startswith("AssertionError (raised at ") and message.endswith(" in run_from)"), message
    assert "test_torch_runner.py:" in message and context is None


class InPlaceAfterTheCut(nn.Module):
    """A correct model whose second stage begins with an in-place op on the value it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pc.pipe_split()
        h += 1.0
        return self.b(torch.relu(h))


def test_an_in_place_op_on_a_received_value_is_named_as_torchs_bug(pipecheck_world: Any) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    assert pc.assert_equivalent(InPlaceAfterTheCut, (x,), n_microbatches=2, world=pipecheck_world(2)).ok
    with pytest.raises(pc.EngineError) as caught:
        pc.assert_equivalent(InPlaceAfterTheCut, (x,), n_microbatches=2, runner="torch", world=pipecheck_world(2))
    lines = str(caught.value).splitlines()
    assert lines[0] == "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation.", lines
    assert lines[1].startswith("This is torch.distributed.pipelining's bug, not your model's: it hands a stage"), lines
