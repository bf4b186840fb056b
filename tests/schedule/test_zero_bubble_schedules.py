"""Zero-bubble schedules as data: ZB-H1 ("zb") and ZB-V ("zbv") as literal tables, action for action
torch's own orders, the I/W rules of the validator, and the paper's bubble under its cost model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from expecttest import assert_expected_inline

from pipecheck.errors import ScheduleError
from pipecheck.schedules import (
    Action,
    Schedule,
    chain_dependencies,
    make_schedule,
    one_f_one_b,
    simulated_bubble_fraction,
    validate,
    zbv,
    zero_bubble_h1,
)

# --------------------------------------------------------------------------- literal tables


def test_zb_h1_table_defers_each_rank_r_weight_gradients_by_r_microbatches() -> None:
    assert_expected_inline(
        zero_bubble_h1(4, 8).table(),
        """\
zb: 4 stages on 4 ranks, 8 micro-batches, 27 steps, bubble 11.1%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24  25  26
rank 0 | 0F0 0F1 0F2 0F3  .   .   .  0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
rank 1 |  .  1F0 1F1 1F2  .   .  1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7
rank 2 |  .   .  2F0 2F1  .  2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7
rank 3 |  .   .   .  3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7""",
    )


def test_zbv_table_places_stages_in_a_v_and_turns_on_the_last_rank() -> None:
    schedule = zbv(2, 4)
    assert schedule.stage_to_rank == (0, 1, 1, 0)  # rank 0: stages 0 and 3; rank 1: stages 1 and 2
    assert_expected_inline(
        schedule.table(),
        """\
zbv: 4 stages on 2 ranks, 4 micro-batches, 25 steps, bubble 4.0%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3  .
rank 1 |  .  1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3""",
    )


def test_zbv_with_fewer_microbatches_than_it_plans_for_leaves_the_missing_ones_out() -> None:
    assert_expected_inline(
        zbv(2, 2).table(),
        """\
zbv: 4 stages on 2 ranks, 2 micro-batches, 14 steps, bubble 14.3%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13
rank 0 | 0F0 0F1  .  3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0  .  0I1 0W1
rank 1 |  .  1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1  .""",
    )


# --------------------------------------------------------------------------- torch's own orders


class _FakeStage:
    """What torch's schedule classes read from a stage to plan their actions (no process group)."""

    def __init__(self, index: int, n_stages: int, n_ranks: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_size, self.group_rank = n_ranks, rank
        self.submod = torch.nn.Identity()
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


def _torch_order(cls_name: str, n_ranks: int, per_rank: int, n_mbs: int, style: str) -> list[list[str]] | None:
    """torch's compute actions per rank (idle slots dropped), or None where torch refuses (n_mbs)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    n_stages = n_ranks * per_rank
    placement = generate_rank_to_stage_mapping(n_ranks, n_stages, style=style)
    stages = [_FakeStage(s, n_stages, n_ranks, 0) for s in placement[0]]
    try:
        schedule = getattr(schedules, cls_name)(stages, n_microbatches=n_mbs)
    except ValueError:
        return None
    return [[str(a) for a in schedule.pipeline_order[rank] if a is not None] for rank in range(n_ranks)]


@pytest.mark.parametrize("n_mbs", range(1, 11))
@pytest.mark.parametrize("n_ranks", range(1, 5))
def test_zb_h1_is_torchs_interleaved_zero_bubble_with_one_stage_per_rank(n_ranks: int, n_mbs: int) -> None:
    torch_order = _torch_order("ScheduleInterleavedZeroBubble", n_ranks, 1, n_mbs, "loop")
    if torch_order is None:
        pytest.skip(f"torch refuses {n_mbs} micro-batches on {n_ranks} ranks (a multiple of its rounds)")
    assert zero_bubble_h1(n_ranks, n_mbs).to_lists() == torch_order


@pytest.mark.parametrize("n_mbs", range(1, 11))
@pytest.mark.parametrize("n_ranks", range(1, 5))
def test_zbv_is_torchs_zbv_zero_bubble(n_ranks: int, n_mbs: int) -> None:
    ours = zbv(n_ranks, n_mbs)
    assert ours.to_lists() == _torch_order("ScheduleZBVZeroBubble", n_ranks, 2, n_mbs, "v")
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert dict(enumerate(ours.stage_to_rank)) == generate_stage_to_rank_mapping(n_ranks, 2 * n_ranks, style="v")


# --------------------------------------------------------------------------- generated schedules


def _zero_bubble_cases() -> list[object]:
    cases: list[object] = []
    for n_mbs in range(1, 10):
        cases += [pytest.param("zb", n, 1, n_mbs, id=f"zb-s{n}-m{n_mbs}") for n in range(1, 7)]
        cases += [pytest.param("zbv", n, 2, n_mbs, id=f"zbv-s{n}-m{n_mbs}") for n in (2, 4, 6, 8)]
    return cases


@pytest.mark.parametrize(("name", "n_stages", "per_rank", "n_mbs"), _zero_bubble_cases())
def test_zero_bubble_schedules_validate_and_run_weight_gradients_in_microbatch_order(
    name: str, n_stages: int, per_rank: int, n_mbs: int
) -> None:
    schedule = make_schedule(name, n_stages, n_mbs, stages_per_rank=per_rank)
    validate(schedule)
    assert schedule.splits_backward and schedule.n_ranks == n_stages // per_rank
    for row in schedule.actions:
        assert all(action.kind != "B" for action in row)
        for stage in {action.stage for action in row}:
            weights = [a.microbatch for a in row if a.kind == "W" and a.stage == stage]
            assert weights == list(range(n_mbs))  # the summation order of every other schedule
    if n_stages >= 3:  # skip connections on top of the chain: stage 0 read by stage 2, and by the last
        validate(schedule, {**chain_dependencies(n_stages), 2: {0, 1}})
        validate(schedule, {**chain_dependencies(n_stages), n_stages - 1: {0, n_stages - 2}})


@pytest.mark.parametrize("n_mbs", range(1, 10))
@pytest.mark.parametrize("n_stages", range(1, 7))
def test_zb_h1_bubble_is_a_third_of_1f1b_when_a_backward_costs_two_forwards(n_stages: int, n_mbs: int) -> None:
    """The paper's claim under its cost model (F = I = W = 1, B = I + W = 2), for n_mbs >= n_stages;
    with fewer micro-batches there are not enough deferred W to fill the cool-down."""
    p, m = n_stages, n_mbs
    one_f_one_b_bubble = simulated_bubble_fraction(one_f_one_b(p, m), durations={"B": 2})
    assert one_f_one_b_bubble == (p - 1) / (m + p - 1)  # 3(m + p - 1) steps of which 3m busy
    zb_bubble = simulated_bubble_fraction(zero_bubble_h1(p, m))
    if m >= p:
        assert zb_bubble == (p - 1) / (3 * m + p - 1)  # 3m + p - 1 steps of which 3m busy
    else:
        assert 0 < zb_bubble < one_f_one_b_bubble


def test_zbv_bubble_under_the_cost_model() -> None:
    bubbles = {p: simulated_bubble_fraction(zbv(p, 8)) for p in (2, 4)}
    assert bubbles == {2: 1 / 49, 4: 2 / 34}  # as torch's own lists simulate


def test_durations_leave_unit_time_tables_unchanged() -> None:
    schedule = one_f_one_b(4, 8)
    assert simulated_bubble_fraction(schedule, durations={"F": 1, "B": 1}) == simulated_bubble_fraction(schedule)


# --------------------------------------------------------------------------- the I/W rules


def test_a_split_backward_that_deadlocks_is_drawn_with_error_markers() -> None:
    rows = [["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"], ["1F1", "1I1", "1W1", "1F0", "1I0", "1W0"]]
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_lists(2, 2, None, rows, name="crossed_zb"))
    assert_expected_inline(
        str(info.value),
        """\
schedule 'crossed_zb' deadlocks: at step 1 no rank can run its next action
step   |   0 | pending
rank 0 | 0F0 | 0I0 0W0 0F1 0I1 0W1   <-- ERROR HERE
rank 1 |  .  | 1F1 1I1 1W1 1F0 1I0 1W0   <-- ERROR HERE
  rank 0 waits at 0I0 for 1I0, which rank 1 will only run after 1F1
  rank 1 waits at 1F1 for 0F1, which rank 0 will only run after 0I0""",
    )


def test_a_weight_gradient_needs_only_its_input_gradient_so_it_fills_a_wait() -> None:
    # Rank 0 runs 0W0 at step 4 while 0I1 still waits for rank 1's 1I1; rank 1 defers its W to the end.
    rows = [["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"], ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]]
    assert_expected_inline(
        Schedule.from_lists(2, 2, None, rows, name="fill").table(),
        """\
fill: 2 stages on 2 ranks, 2 micro-batches, 7 steps, bubble 14.3%
step   |   0   1   2   3   4   5   6
rank 0 | 0F0 0F1  .  0I0 0W0 0I1 0W1
rank 1 |  .  1F0 1I0 1F1 1I1 1W0 1W1""",
    )


def _zb(rows: list[list[str]]) -> None:
    validate(Schedule.from_lists(2, 2, None, rows))


_ROW1 = ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]

# fmt: off
INVALID = [
    pytest.param(lambda: _zb([["0F0", "0F1", "0I0", "0W0", "0I1"], _ROW1]), "missing 1 action(s): 0W1 (every stage runs one F and either one B or one I and one W per micro-batch)", id="weight-dropped"),
    pytest.param(lambda: _zb([["0F0", "0F1", "0I0", "0W0", "0W1"], _ROW1]), "missing 1 action(s): 0I1", id="input-gradient-dropped"),
    pytest.param(lambda: _zb([["0F0", "0F1", "0I0", "0W0", "0I1", "0W1", "0W1"], _ROW1]), "0W1 appears 2 times (rank 0 position 5, rank 0 position 6); keep exactly one", id="weight-twice"),
    pytest.param(lambda: _zb([["0F0", "0F1", "0W0", "0I0", "0I1", "0W1"], _ROW1]), "rank 0 runs 0W0 (position 2) before its input gradient 0I0 (position 3); move the I earlier", id="weight-before-input-gradient"),
    pytest.param(lambda: _zb([["0F0", "0I1", "0F1", "0I0", "0W0", "0W1"], _ROW1]), "rank 0 runs 0I1 (position 1) before its forward 0F1 (position 2)", id="input-gradient-before-forward"),
    pytest.param(lambda: _zb([["0F0", "0F1", "0B0", "0I0", "0W0", "0I1", "0W1"], _ROW1]), "0B0 and a split backward (0I0/0W0) both appear", id="full-and-split-backward"),
    pytest.param(lambda: _zb([["0F0", "0F1", "0I0", "0W0", "0I1", "0W1", "1W0"], _ROW1[:2] + _ROW1[3:]]), "1W0 runs stage 1, which stage_to_rank puts on rank 1", id="weight-on-another-rank"),
    pytest.param(lambda: make_schedule("zb", 4, 4, stages_per_rank=2), "the 'zb' schedule runs one stage per rank (stages_per_rank=2); use 'zbv' (two per rank) or 'interleaved'", id="zb-two-stages-per-rank"),
    pytest.param(lambda: make_schedule("zbv", 4, 4), "places exactly two stages on each rank, in a V (stage r and n_stages - 1 - r on rank r), but stages_per_rank=1; pass stages_per_rank=2", id="zbv-one-stage-per-rank"),
    pytest.param(lambda: make_schedule("zbv", 3, 4, stages_per_rank=2), "needs an even number of stages (two per rank, in a V), but n_stages=3; cut the model into 2 or 4 stages", id="zbv-odd-stages"),
    pytest.param(lambda: make_schedule("DualPipeV", 4, 8, stages_per_rank=2), "'DualPipeV' is a torch.distributed.pipelining schedule: run it with runner='torch'", id="torch-only-name"),
    pytest.param(lambda: Action.parse("0X1"), "expected '{stage}{F|B|I|W}{microbatch}'", id="unparsable-kind"),
]
# fmt: on


@pytest.mark.parametrize(("build", "message"), INVALID)
def test_invalid_zero_bubble_schedule_or_layout_raises_schedule_error(build: Callable[[], object],
                                                                     message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        build()
    assert message in str(info.value)


def test_zero_bubble_names_and_aliases() -> None:
    assert make_schedule("ZB", 3, 4) == zero_bubble_h1(3, 4) == make_schedule("zb-h1", 3, 4)
    assert make_schedule("ZBV", 4, 4, stages_per_rank=2) == zbv(2, 4)
    assert Action.parse(" 2w3 ") == Action("W", 2, 3) and str(Action("I", 1, 0)) == "1I0"
    rebuilt = Schedule.from_lists(4, 4, (0, 1, 1, 0), zbv(2, 4).to_lists(), name="zbv")
    assert rebuilt == zbv(2, 4)
