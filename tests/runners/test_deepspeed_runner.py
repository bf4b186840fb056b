"""runner="deepspeed" and pc.engines.deepspeed.check: DeepSpeed's PipelineEngine on pipecheck's World.

Without DeepSpeed: how a split becomes a layer chain, and DeepSpeed's boundary rules checked in one
process. With it (``pip install "torch-pipecheck[deepspeed]"``): every zoo model through DeepSpeed,
layer lists (tied specs, tuples, skips), what DeepSpeed cannot run refused before any rank
starts, what it computes differently from eager failing the check, and a failure inside DeepSpeed
as an EngineError naming the engine, rank and stage. The test that makes DeepSpeed fail on a
rank comes last: it costs its World a restart.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pipecheck.fixtures import ZOO, get

import pipecheck as pc
from pipecheck import Source
from pipecheck._runners.deepspeed.layers import (
    LayerListModel,
    boundary_problems,
    layer_param_counts,
    split_layout,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ranks unpickle _engine_models by name
import _engine_models as em  # noqa: E402
import _training_models as tm  # noqa: E402

N_MICROBATCHES = 4
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason='needs DeepSpeed: pip install "torch-pipecheck[deepspeed]"')


def _zoo_pipe(name: str) -> tuple[pc.Pipe, dict[str, Any]]:
    entry = get(name)
    args, kwargs = entry.inputs()
    pipe = pc.split(entry.factory(entry.cut_styles[0]), args, kwargs, **entry.cut(entry.cut_styles[0]))
    return pipe, pipe.bind_inputs(args, kwargs)


# --- no DeepSpeed needed -----------------------------------------------------------------------------


def test_a_skip_travels_through_the_stages_in_between() -> None:
    layout = split_layout(*_zoo_pipe("long_skip"))
    assert layout.feed == ("x",)
    assert layout.carried == (
        (Source(None, "x"),),
        (Source(0, "blocks_0_norm"),),
        (Source(0, "blocks_0_norm"), Source(1, "blocks_1_norm")),
        (Source(0, "blocks_0_norm"), Source(2, "blocks_2_norm")),
    )


def test_a_keyword_input_read_by_a_later_stage_is_fed_and_carried() -> None:
    layout = split_layout(*_zoo_pipe("kwarg_last"))
    assert layout.feed == ("x", "bias")
    assert layout.carried[2] == (Source(1, "blocks_1_norm"), Source(None, "bias"))


def test_tied_parameters_are_grouped_by_the_stages_sharing_them() -> None:
    layout = split_layout(*_zoo_pipe("alias_reuse"))
    assert [(t.key, t.fqns) for t in layout.tied] == [
        ("stages_0_2", ("proj.weight", "shared.fc.weight", "shared.fc.bias", "shared.norm.weight",
                        "shared.norm.bias"))]


@pytest.mark.parametrize("stages,expected", [
    pytest.param([em.WithScale(), em.UseScale()], "stage 0 sends a tuple holding [1] a float to stage 1: DeepSpeed "
                 "sends only a tensor or a tuple of tensors", id="python-float"),
    pytest.param([lambda x: {"h": x * 2}, lambda d: d["h"]], "stage 0 sends a dict to stage 1", id="dict"),
    pytest.param([em.SkipInput(), em.Merge()], "stage 0 sends [1] a float32 tensor of shape (2, 8) that does not "
                 "require grad (a model input or a constant)", id="input-carried"),
    pytest.param([em.SplitSkip(), em.DropSecond()], "stage 1 receives [1] a float32 tensor of shape (2, 8) from "
                 "stage 0 but computes no gradient for it", id="received-unused"),
])
def test_what_deepspeed_cannot_carry_across_a_boundary_is_found_in_one_process(stages: list[Any],
                                                                                expected: str) -> None:
    x = torch.randn(2, em.WIDTH)
    problems = boundary_problems(stages, x, lambda out: out.sum())
    assert expected in "\n".join(p.message for p in problems)


def test_a_chain_deepspeed_can_run_has_no_boundary_problem() -> None:
    stages = [em.SplitSkip(), em.OnFirst(), em.Merge()]
    assert boundary_problems(stages, torch.randn(2, em.WIDTH), lambda out: out.sum()) == []


@needs_deepspeed
def test_a_split_passing_what_is_neither_a_tensor_nor_a_number_is_refused_before_any_rank_starts() -> None:
    world = pc.World(2)  # never started: the refusal comes first
    try:
        with pytest.raises(pc.EngineError, match=r"stage 0 sends a tuple holding \[1\] a Size to stage 1") as caught:
            pc.assert_equivalent(em.ShapeAcross, (em._randn(em.BATCH, em.WIDTH, seed=1),), runner="deepspeed",
                                 n_microbatches=N_MICROBATCHES, world=world)
        assert (caught.value.engine, caught.value.rank, caught.value.stage) == ("DeepSpeed", 0, 0)
        assert world.pids == ()
    finally:
        world.close()


def test_engine_refusals_of_the_job_are_input_errors() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    with pytest.raises(pc.InputError, match="DeepSpeed's PipelineEngine runs its own TrainSchedule"):
        _need_deepspeed_runner()(pc.Job(entry.factory(), args, kwargs, schedule="gpipe", n_microbatches=4))
    with pytest.raises(pc.InputError, match="one stage per rank"):
        _need_deepspeed_runner()(pc.Job(entry.factory(), args, kwargs, stages_per_rank=2, n_microbatches=4))


def test_a_float64_check_is_refused_before_deepspeed_asserts_on_its_gradients() -> None:
    """DeepSpeed's reduce asserts 'unsupported grad type: torch.float64' on its CPU accelerator."""
    entry = get("mlp")
    args, kwargs = entry.inputs()
    model = pc.ModelFactory(entry.factory(), dtype=torch.float64)
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    with pytest.raises(pc.InputError, match=r"float64 parameters: DeepSpeed reduces gradients only in .*"
                                            r"check it in float32 \(dtype=torch.float32\)"):
        _need_deepspeed_runner()(pc.Job(model, args, kwargs, n_microbatches=4))


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * scale
        pc.pipe_split()
        return self.b(h)


def test_a_replicated_input_that_needs_its_gradient_is_refused_not_reported_missing() -> None:
    """DeepSpeed's pipe carries only micro-batched tensors; a replicated value reaches each stage as
    a constant, so its gradient could never come back: refused before any rank starts."""
    x, scale = torch.randn(8, 4), torch.randn(4, requires_grad=True)
    with pytest.raises(pc.InputError, match=r"gradients of pc.Replicated inputs \(\['scale'\]\).*requires_grad=False"):
        _need_deepspeed_runner()(pc.Job(Scaled(), (x, pc.Replicated(scale)), {}, n_microbatches=4))


def _need_deepspeed_runner() -> Any:
    from pipecheck._runners.deepspeed.driver import run_deepspeed

    return run_deepspeed


# --- with DeepSpeed ----------------------------------------------------------------------------------------


@needs_deepspeed
def test_layer_list_reference_names_parameters_as_deepspeed_does() -> None:
    layers, _, _ = em.tied_layers()
    model = LayerListModel(layers, parts=[0, 2, 4])
    assert [name for name, _ in model.named_parameters()] == [
        "tied_modules.embed.weight", "1.fc.weight", "1.fc.bias", "1.norm.weight", "1.norm.bias",
        "2.fc.weight", "2.fc.bias", "2.norm.weight", "2.norm.bias"]
    assert layer_param_counts(model) == [128, 88, 88, 128]  # a tied layer counts at every use, as DeepSpeed's


def _zoo_check(name: str, world: pc.World) -> pc.Report:
    entry = get(name)
    args, kwargs = entry.inputs()
    style = entry.cut_styles[0]
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner="deepspeed", loss_fn=entry.loss_fn,
                                target=entry.target(), n_microbatches=N_MICROBATCHES, world=world, **entry.cut(style))


@needs_deepspeed
@pytest.mark.parametrize("name", [entry.name for entry in ZOO])
def test_every_zoo_model_matches_eager_through_deepspeed(pipecheck_world: Any, name: str) -> None:
    report = _zoo_check(name, pipecheck_world(get(name).num_stages))
    assert report.ok
    assert any(row.name.startswith("grad ") for row in report.rows)


@needs_deepspeed
def test_input_gradients_come_back_from_the_first_stage_also_for_inputs_carried_on(pipecheck_world: Any) -> None:
    entry = get("kwarg_last")  # bias: a keyword input stage 0 passes on to stage 2
    args, kwargs = entry.inputs()
    args = tuple(a.requires_grad_() for a in args)
    kwargs = {name: value.requires_grad_() for name, value in kwargs.items()}
    report = pc.assert_equivalent(entry.factory(), args, kwargs, runner="deepspeed", n_microbatches=N_MICROBATCHES,
                                  world=pipecheck_world(3))
    assert report.ok
    assert {"grad input x", "grad input bias"} <= {row.name for row in report.rows}


@needs_deepspeed
def test_a_python_number_between_stages_travels_as_a_tensor(pipecheck_world: Any) -> None:
    report = pc.assert_equivalent(em.SizeAcross, (em._randn(em.BATCH, em.WIDTH, seed=1),), runner="deepspeed",
                                  n_microbatches=N_MICROBATCHES, world=pipecheck_world(2))
    assert report.ok


@needs_deepspeed
def test_tied_replicas_are_each_reported_and_each_holds_the_full_gradient(pipecheck_world: Any) -> None:
    report = _zoo_check("tiny_gpt", pipecheck_world(4))
    names = [row.name for row in report.rows]
    assert "grad tok_emb.weight (replica in stage 0)" in names
    assert "grad tok_emb.weight (replica in stage 3)" in names


def _check_layers(world: pc.World, layers: list[Any], inputs: Any, target: Any, loss_fn: Any = em.mse,
                  **options: Any) -> pc.Report:
    return pc.engines.deepspeed.check(layers, inputs, num_stages=2, loss_fn=loss_fn, target=target,
                                      n_microbatches=N_MICROBATCHES, world=world, **options)


@needs_deepspeed
@pytest.mark.parametrize("make,loss_fn", [
    pytest.param(em.plain_layers, em.mse, id="plain"),
    pytest.param(em.batchnorm_layers, em.mse, id="batchnorm-buffers"),
    pytest.param(em.tied_layers, em.lm_loss, id="tied-embedding-and-head"),
    pytest.param(lambda: em.chain("SplitSkip", "OnFirst", "OnFirst", "Merge"), em.mse, id="skip-as-tuple"),
])
def test_a_layer_list_matches_the_same_layers_run_eagerly(pipecheck_world: Any, make: Any, loss_fn: Any) -> None:
    layers, inputs, target = make()
    report = _check_layers(pipecheck_world(2), layers, inputs, target, loss_fn)
    assert report.ok and not report.notes  # every buffer the layers hold was compared, none skipped
    buffers = [row for row in report.rows if row.name.startswith("buffer ")]
    assert bool(buffers) == (make is em.batchnorm_layers) and all(row.ok for row in buffers)


@needs_deepspeed
def test_the_partition_method_decides_where_the_check_cuts(pipecheck_world: Any) -> None:
    layers, inputs, target = em.plain_layers()  # parameters per layer: 72, 0, 88, 36
    uniform = _check_layers(pipecheck_world(2), layers, inputs, target, partition_method="uniform")
    by_params = _check_layers(pipecheck_world(2), layers, inputs, target, partition_method="parameters")
    assert uniform.ok and by_params.ok
    assert uniform.row("grad 2.fc.weight").stages == (1,)  # layers [0, 2) | [2, 4)
    assert by_params.row("grad 0.weight").stages == (0,) and by_params.row("grad 3.weight").stages == (1,)


@needs_deepspeed
def test_deepspeed_syncs_only_the_tied_weight_attr_so_a_tied_bias_fails(pipecheck_world: Any) -> None:
    layers, inputs, target = em.tied_bias_layers()
    with pytest.raises(pc.EquivalenceError) as caught:
        _check_layers(pipecheck_world(2), layers, inputs, target)
    failing = [row.name for row in caught.value.report.failures]
    assert "grad tied_modules.shared.bias (replica in stage 1)" in failing
    assert not any("shared.weight" in name for name in failing)  # tied_weight_attr=['weight'] is summed
    assert "tied parameter not synchronised" in caught.value.report.hints["grad tied_modules.shared.bias"]
    layers, inputs, target = em.tied_bias_layers(("weight", "bias"))  # the fix: name every tied parameter
    assert _check_layers(pipecheck_world(2), layers, inputs, target).ok


@needs_deepspeed
@pytest.mark.parametrize("names,expected", [
    pytest.param(("SkipInput", "OnFirst", "OnFirst", "Merge"), "does not require grad", id="input-carried"),
    pytest.param(("SplitSkip", "OnFirst", "OnFirst", "DropSecond"), "computes no gradient for it",
                 id="received-unused"),
    pytest.param(("WithScale", "UseScale"), "a tuple holding [1] a float", id="python-float"),
])
def test_what_deepspeed_cannot_run_is_refused_before_any_rank_starts(names: tuple[str, ...], expected: str) -> None:
    layers, inputs, target = em.chain(*names)
    world = pc.World(2)  # never started: the refusal comes first
    try:
        with pytest.raises(pc.EngineError, match="refused before any rank started") as caught:
            _check_layers(world, layers, inputs, target)
        assert expected in str(caught.value)
        assert caught.value.engine == "DeepSpeed" and caught.value.stage == caught.value.rank is not None
        assert world.pids == ()
    finally:
        world.close()


@needs_deepspeed
def test_rank_resources_stay_flat_over_many_deepspeed_jobs(pipecheck_world: Any) -> None:
    world = pipecheck_world(2)
    layers, inputs, target = em.tied_layers()
    _check_layers(world, layers, inputs, target, loss_fn=em.lm_loss)
    before = world.run(em.rank_resources)
    for _ in range(3):
        _check_layers(world, layers, inputs, target, loss_fn=em.lm_loss)
    after = world.run(em.rank_resources)
    for rank, (was, now) in enumerate(zip(before, after)):
        assert now["groups"] == was["groups"], f"rank {rank} leaks process groups: {was} -> {now}"
        assert now["threads"] <= was["threads"] + 2, f"rank {rank} leaks threads: {was} -> {now}"


# --- training: one engine across optimizer steps, DeepSpeed's own data parallel ---------------------------

TRAINING = dict(n_microbatches=N_MICROBATCHES, steps=3, accumulation_steps=2, optimizer=tm.adamw,
                loss_fn=tm.token_ce, loss_reduction="token_mean", runner="deepspeed")


def _train(world: pc.World, model: Any = tm.make_tied_lm, **options: Any) -> pc.Report:
    x, y = tm.tokens(pad=3)
    return pc.assert_equivalent(model, (x,), target=y, world=world, **{**TRAINING, **options})


@needs_deepspeed
@pytest.mark.parametrize("reduction, loss_fn", [("token_mean", tm.token_ce), ("mean", tm.mean_ce),
                                                ("sum", tm.mean_ce)])
def test_deepspeed_trains_several_steps_with_accumulation_like_eager(pipecheck_world: Any, reduction: str,
                                                                      loss_fn: Any) -> None:
    report = _train(pipecheck_world(2), loss_reduction=reduction, loss_fn=loss_fn)
    assert report.ok
    names = {row.name for row in report.rows}
    assert {"step 2: param emb.weight (replica in stage 1)", "step 2: grad l2.weight",
            "step 0: output (schedule step 1 of 2)"} <= names


@needs_deepspeed
def test_deepspeeds_own_data_parallel_runs_pp2_by_dp2_on_a_world_of_four(pipecheck_world: Any) -> None:
    report = _train(pipecheck_world(4), data_parallel=2, steps=2)
    assert report.ok
    assert report.row("step 1: param emb.weight (dp rank 1, stage 1)").ok
    assert report.row("step 1: grad l2.bias (dp rank 1, stage 1)").ok


@needs_deepspeed
def test_deepspeed_leaves_a_frozen_parameter_as_it_was(pipecheck_world: Any) -> None:
    report = _train(pipecheck_world(2), model=tm.make_frozen_lm)
    assert report.ok and report.row("step 2: param l1.weight").ok


@needs_deepspeed
def test_deepspeed_with_its_data_parallel_all_reduce_off_is_caught_at_every_replica(pipecheck_world: Any) -> None:
    from pipecheck._runners.deepspeed.driver import DeepSpeedRunner

    with pytest.raises(pc.EquivalenceError) as caught:
        _train(pipecheck_world(4), runner=DeepSpeedRunner(em.UnreducedReplicas), data_parallel=2, steps=2)
    failing = {row.name for row in caught.value.report.failures}
    assert {"step 0: grad l1.weight", "step 0: grad l1.weight (dp rank 1, stage 0)"} <= failing
    assert "step 0: loss" not in failing  # the forward is right: only the reduction is missing


@needs_deepspeed
def test_deepspeed_clips_by_stage_zeros_gradient_norm_alone(pipecheck_world: Any) -> None:
    """DeepSpeed's fp32 clipping in a pipeline counts only the model-parallel rank 0's gradients, and a
    pipeline's stages are its model-parallel group: the norm is stage 0's. The check flags the optimizer step
    where stage 1's parameters change the norm (measured once on this model, one SGD step at
    clip_grad_norm=0.05: DeepSpeed applied stage 0's coefficient 0.060, the whole model's is 0.037)."""
    with pytest.raises(pc.EquivalenceError) as caught:
        _train(pipecheck_world(2), clip_grad_norm=0.5)
    report = caught.value.report
    failing = {row.name for row in report.failures}
    assert not any(name.startswith(("step 0: ", "step 1: grad ")) for name in failing)  # before clipping: right
    assert "step 1: param l2.weight" in failing
    assert "optimizer step 1 of 3 (step 0 matches), in its parameters after the optimizer step" in report.located
    assert "clipping's norm over the stages" in report.hints["step 1: param emb.weight"]
    assert _train(pipecheck_world(2), clip_grad_norm=1e6).ok  # a norm never reached: nothing clipped, and right


@needs_deepspeed
def test_deepspeed_clipping_on_a_stage_without_gradients_fails_inside_deepspeed(pipecheck_world: Any) -> None:
    with pytest.raises(pc.EngineError) as caught:  # its clip_grad_norm_ reads parameters[0] of an empty list
        _train(pipecheck_world(2), model=tm.make_front_loaded, clip_grad_norm=0.5)
    assert (caught.value.rank, caught.value.stage) == (1, 1)
    assert str(caught.value).startswith("IndexError")
    assert "gradient_clipping=0.5" in str(caught.value)
    assert _train(pipecheck_world(2), model=tm.make_front_loaded).ok  # without clipping it trains right


@needs_deepspeed
@pytest.mark.parametrize("order", ["between-optimizer-steps", "within-an-optimizer-step"])
def test_deepspeed_takes_batches_whose_shapes_change(pipecheck_world: Any, order: str) -> None:
    """Between optimizer steps: engine.reset_activation_shape(); within one: PipelineModule(dynamic_shape=True)."""
    short, long = tm.tokens(seq=5, pad=2), tm.tokens(seq=7, seed=1, pad=2)
    sequence = (short, short, long, long) if order == "between-optimizer-steps" else (short, long, long, short)
    batches = [pc.Batch((x,), target=y) for x, y in sequence]
    report = pc.assert_equivalent(tm.make_tied_lm, (short[0],), batches=batches, world=pipecheck_world(2),
                                  **{**TRAINING, "steps": 2})
    assert report.ok


def test_deepspeed_refuses_a_batch_its_replicas_and_micro_batches_cannot_share_equally() -> None:
    pytest.importorskip("deepspeed")
    world = pc.World(4)  # never started: the refusal comes first
    try:
        x, y = tm.tokens(batch=6)
        with pytest.raises(pc.InputError, match=r"batch of 6 rows does not split into 2 x 2 equal micro-batches"):
            pc.assert_equivalent(tm.make_tied_lm, (x,), target=y, world=world, data_parallel=2,
                                 **{**TRAINING, "n_microbatches": 2, "accumulation_steps": 1})
        assert world.pids == ()
    finally:
        world.close()


@needs_deepspeed
def test_a_failure_inside_deepspeed_is_an_engine_error_naming_rank_and_stage() -> None:
    layers, inputs, target = em.chain("SplitSkip", "OnFirst", "OnFirst", "FailsOnRank")
    with pc.World(2, timeout=120) as world:
        with pytest.raises(pc.EngineError) as caught:
            _check_layers(world, layers, inputs, target)
    err = caught.value
    assert (err.engine, err.rank, err.stage) == ("DeepSpeed", 1, 1)
    assert str(err).startswith("ValueError: planted failure inside the engine")
    assert "DeepSpeed failed on rank 1, stage 1" in str(err)
