"""runner="torch" with every torch schedule: zero-bubble (I/W) and V-placed ones included.

Names and layout rules are checked on the driver before any rank starts, and
they accept exactly what torch's own schedule classes accept. Then the
schedules run on pipecheck's World: right on a plain model; wrong where torch
is wrong (tied replicas never summed, also when V placement puts both on one
rank); an EngineError with torch's message where torch cannot run a model.

Tests that make torch fail on a rank come last per world size: a rank failure
stops that World's processes, and the next test on it starts fresh ones.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _torch_findings import SKIP
from pipecheck.fixtures import get

import pipecheck as pc

# private: the torch runner's plan is where torch's schedule table is applied
from pipecheck._runners.torch_pipelining.driver import plan_torch_step
from pipecheck._schedule.torch_classes import ALIASES, TORCH_SCHEDULES, torch_layout, v_warmup_patch

N_MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _quiet_torch_export() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def check(world: pc.World, name: str, schedule: str, per_rank: int, model: Any = None, **overrides: Any
          ) -> pc.Report:
    entry = get(name)
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    settings = {"loss_fn": entry.loss_fn, "target": entry.target(), "n_microbatches": N_MICROBATCHES,
                **entry.cut(style), **overrides}
    return pc.assert_equivalent(entry.factory(style) if model is None else model, args, kwargs, runner="torch",
                                schedule=schedule, stages_per_rank=per_rank, world=world, **settings)


# --- no World needed: names and layouts ----------------------------------------------------------------


class _FakeStage:
    """What torch's schedule classes read from a stage to plan their actions (no process group)."""

    def __init__(self, index: int, n_stages: int, n_ranks: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_size, self.group_rank = n_ranks, rank
        self.submod = torch.nn.Identity()
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


def _torch_accepts(class_name: str, placement: tuple[int, ...], n_mbs: int) -> bool:
    from torch.distributed.pipelining import schedules

    n_ranks = max(placement) + 1
    stages = [_FakeStage(s, len(placement), n_ranks, 0) for s, rank in enumerate(placement) if rank == 0]
    cls = getattr(schedules, class_name)
    try:
        cls(stages[0] if issubclass(cls, schedules.PipelineScheduleSingle) else stages, n_microbatches=n_mbs)
    except ValueError:
        return False
    return True


def _layout_cases() -> list[object]:
    return [pytest.param(key, n_ranks, per_rank, id=f"{key}-p{n_ranks}-x{per_rank}")
            for key, schedule in TORCH_SCHEDULES.items() for n_ranks in (1, 2, 3, 4)
            for per_rank in ((schedule.stages_per_rank,) if schedule.stages_per_rank else (1, 2))]


@pytest.mark.parametrize("key,n_ranks,per_rank", _layout_cases())
def test_layout_rules_accept_exactly_what_torch_accepts(key: str, n_ranks: int, per_rank: int) -> None:
    """pipecheck refuses a micro-batch count on the driver iff torch's class refuses it on a rank."""
    n_stages = n_ranks * per_rank
    for n_mbs in range(1, 13):
        try:
            layout = torch_layout(key, n_stages, n_mbs, per_rank)
        except pc.ScheduleError:
            layout = None
        full = torch_layout(key, n_stages, 12 * n_stages, per_rank)  # fits every rule
        assert (layout is not None) == _torch_accepts(full.class_name, full.stage_to_rank, n_mbs), n_mbs


@pytest.mark.parametrize("name,key,class_name,placement", [
    ("interleaved_zb", "interleaved_zb", "ScheduleInterleavedZeroBubble", (0, 1, 0, 1)),
    ("InterleavedZeroBubble", "interleaved_zb", "ScheduleInterleavedZeroBubble", (0, 1, 0, 1)),
    ("ScheduleInterleavedZeroBubble", "interleaved_zb", "ScheduleInterleavedZeroBubble", (0, 1, 0, 1)),
    ("zbv", "zbv", "ScheduleZBVZeroBubble", (0, 1, 1, 0)),
    ("ZBVZeroBubble", "zbv", "ScheduleZBVZeroBubble", (0, 1, 1, 0)),
    ("ScheduleZBVZeroBubble", "zbv", "ScheduleZBVZeroBubble", (0, 1, 1, 0)),
    ("dualpipev", "dualpipev", "ScheduleDualPipeV", (0, 1, 1, 0)),
    ("DualPipeV", "dualpipev", "ScheduleDualPipeV", (0, 1, 1, 0)),
    ("ScheduleDualPipeV", "dualpipev", "ScheduleDualPipeV", (0, 1, 1, 0)),
    ("LoopedBFS", "looped_bfs", "ScheduleLoopedBFS", (0, 1, 0, 1)),
    ("Interleaved1F1B", "interleaved", "ScheduleInterleaved1F1B", (0, 1, 0, 1)),
    ("GPipe", "gpipe", "ScheduleLoopedBFS", (0, 1, 0, 1)),
])
def test_pipecheck_and_torch_names_map_to_torch_classes_and_placements(name, key, class_name, placement):
    layout = torch_layout(name, 4, 8, 2)
    assert (layout.key, layout.class_name, layout.stage_to_rank) == (key, class_name, placement)


def test_one_stage_per_rank_names() -> None:
    assert torch_layout("zb", 4, 4, 1).class_name == "ScheduleInterleavedZeroBubble"  # ZB-H1
    assert torch_layout("1F1B", 4, 4, 1).class_name == "Schedule1F1B"
    assert torch_layout("ScheduleGPipe", 4, 4, 1).class_name == "ScheduleGPipe"
    assert set(ALIASES.values()) == set(TORCH_SCHEDULES)


# fmt: off
REFUSED = [
    pytest.param("zbv", 4, 4, 1, "ScheduleZBVZeroBubble places exactly 2 stages on each rank, in a V (stage r and n_stages - 1 - r on rank r), but stages_per_rank=1; pass stages_per_rank=2", id="zbv-loop-placed"),
    pytest.param("dualpipev", 4, 3, 2, "ScheduleDualPipeV needs at least as many micro-batches as stages (n_microbatches=3, 4 stages); use n_microbatches=4 or more", id="dualpipev-few-microbatches"),
    pytest.param("dualpipev", 3, 4, 2, "n_stages=3 is not a multiple of stages_per_rank=2", id="dualpipev-odd-stages"),
    pytest.param("interleaved_zb", 4, 5, 2, "ScheduleInterleavedZeroBubble needs n_microbatches to be a multiple of its number of rounds, max(1, n_microbatches // ranks) = 2 (n_microbatches=5, 2 ranks); use 4 or 6", id="interleaved-zb-rounds"),
    pytest.param("zb", 4, 4, 2, "'zb' runs one stage per rank (stages_per_rank=2); use 'interleaved_zb' for several", id="zb-two-per-rank"),
    pytest.param("1f1b", 4, 2, 1, "Schedule1F1B needs at least as many micro-batches as stages (n_microbatches=2, 4 stages)", id="1f1b-few-microbatches"),
    pytest.param("zigzag", 4, 4, 1, "unknown schedule 'zigzag' for runner='torch'; valid names: 'gpipe', 'looped_bfs', '1f1b', 'interleaved', 'zb', 'interleaved_zb', 'zbv', 'dualpipev'", id="unknown"),
]
# fmt: on


@pytest.mark.parametrize("name,n_stages,n_mbs,per_rank,message", REFUSED)
def test_layout_torch_cannot_run_is_a_schedule_error_with_the_fix(name, n_stages, n_mbs, per_rank, message):
    with pytest.raises(pc.ScheduleError) as info:
        torch_layout(name, n_stages, n_mbs, per_rank)
    assert message in str(info.value)


def test_a_refused_layout_never_starts_a_rank() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    world = pc.World(4)  # not started: a check that got past the layout would start its ranks
    try:
        with pytest.raises(pc.ScheduleError, match="pass stages_per_rank=2"):
            pc.assert_equivalent(entry.factory(), args, kwargs, runner="torch", schedule="zbv", n_microbatches=4,
                                 world=world)
        assert world.pids == ()
    finally:
        world.close()


def test_v_schedules_place_stage_r_and_2p_minus_1_minus_r_on_rank_r() -> None:
    entry = get("mlp")
    args, kwargs = entry.inputs()
    job = pc.Job(model=pc.ModelFactory(entry.factory()), args=args, kwargs=kwargs, n_microbatches=4,
                 schedule="ZBVZeroBubble", stages_per_rank=2)
    spec = plan_torch_step(job, job.split())
    assert (spec.schedule, spec.torch_class, spec.stage_to_rank) == ("zbv", "ScheduleZBVZeroBubble", (0, 1, 1, 0))


def test_the_warmup_workaround_leaves_a_stage_without_a_warmup_alone() -> None:
    class Stage:  # torch >= 2.15: no p2p warm-up exchange, so nothing to drop
        pass

    stage = Stage()
    v_warmup_patch(stage, rank=1)
    assert vars(stage) == {}


def test_the_warmup_workaround_drops_only_messages_to_the_stages_own_rank() -> None:
    class Op:
        def __init__(self, peer: int) -> None:
            self.group_peer = peer

    class Stage:
        def _get_init_p2p_neighbors_ops(self) -> list[Op]:
            return [Op(0), Op(1), Op(1)]

    stage = Stage()
    v_warmup_patch(stage, rank=1)
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0]


# --- torch runs it right ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,per_rank,world_size", [
    ("zb", 1, 4), ("interleaved_zb", 1, 4), ("interleaved_zb", 2, 2), ("ScheduleZBVZeroBubble", 2, 2),
    ("dualpipev", 2, 2),
])
def test_torch_zero_bubble_schedules_match_eager_on_a_plain_model(pipecheck_world, schedule, per_rank, world_size):
    report = check(pipecheck_world(world_size), "mlp", schedule, per_rank)
    assert report.ok and report.num_stages == 4


# --- torch runs it, wrongly: tied replicas, even on one rank ---------------------------------------------


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_torch_v_schedules_leave_tied_replicas_on_one_rank_unsummed(pipecheck_world, schedule) -> None:
    """Under V placement stage 0 and stage 3 (both holding tok_emb.weight) are on rank 0; torch's
    pipeline() still gives each stage its own copy, and nothing sums them."""
    with pytest.raises(pc.EquivalenceError) as caught:
        check(pipecheck_world(2), "tiny_gpt", schedule, 2)
    report = caught.value.report
    assert "grad tok_emb.weight" in [row.name for row in report.failures]
    assert "tied parameter not synchronised" in report.hints["grad tok_emb.weight"]
    assert "stages 0, 3 hold replicas" in report.hints["grad tok_emb.weight"]


# --- torch cannot run it: EngineError with torch's message (these stop the World) -------------------------


class ReusedWeight(nn.Module):
    """Stage 1 applies one Linear twice with another Linear between: a(b(a(h)))."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        pc.pipe_split()
        return self.a(torch.tanh(self.b(torch.tanh(self.a(h)))))


def test_torch_zero_bubble_cannot_split_a_backward_that_reuses_a_weight(pipecheck_world) -> None:
    """torch's W walks the graph once per parameter group and frees it after the first; pipecheck's own
    "zb" (one walk over all parameters) runs the same model and matches eager."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    assert pc.assert_equivalent(ReusedWeight, (x,), runner="distributed", schedule="zb", n_microbatches=2,
                                world=pipecheck_world(2)).ok
    with pytest.raises(pc.EngineError) as caught:
        pc.assert_equivalent(ReusedWeight, (x,), runner="torch", schedule="zb", n_microbatches=2,
                             world=pipecheck_world(2))
    assert "Trying to backward through the graph a second time" in str(caught.value).splitlines()[0]
    assert caught.value.stage == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_torch_v_schedules_cannot_run_a_skip_connection(pipecheck_world, schedule) -> None:
    with pytest.raises(pc.EngineError) as caught:
        check(pipecheck_world(2), "long_skip", schedule, 2)
    assert str(caught.value).splitlines()[0] == SKIP


def loss_as_a_view(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target).reshape(1)[0]  # the same value, as a 0-dim view


def test_torch_zero_bubble_cannot_take_a_loss_that_is_a_view(pipecheck_world) -> None:
    """torch's input-gradient step detaches the loss in place, which a view refuses."""
    entry = get("mlp")
    args, kwargs = entry.inputs()
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(pc.EngineError) as caught:
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="torch", schedule="zbv", stages_per_rank=2,
                             n_microbatches=N_MICROBATCHES, loss_fn=loss_as_a_view, target=target,
                             world=pipecheck_world(2))
    assert str(caught.value).startswith("RuntimeError: Can't detach views in-place")


def test_a_schedule_class_this_torch_lacks_is_pipecheck_s_adapter_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an n/a cell that the zoo counts as a pass: pipecheck's table of torch's classes is wrong here."""
    from torch.distributed.pipelining import schedules

    monkeypatch.delattr(schedules, "ScheduleDualPipeV")
    with pytest.raises(pc.AdapterError, match=r"has no ScheduleDualPipeV \(schedule 'dualpipev'\).*Fix: install"):
        torch_layout("dualpipev", 4, 4, 2)
