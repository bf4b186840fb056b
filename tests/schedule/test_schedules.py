"""Schedules as data: literal tables, validation, deadlock reports, bubbles."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from expecttest import assert_expected_inline

from pipecheck.errors import ScheduleError
from pipecheck.schedules import (
    Action,
    Schedule,
    chain_dependencies,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    simulated_bubble_fraction,
    validate,
)

# --------------------------------------------------------------------------- literal tables


def test_gpipe_table_runs_all_forwards_then_all_backwards() -> None:
    assert_expected_inline(
        gpipe(4, 4).table(),
        """\
gpipe: 4 stages on 4 ranks, 4 micro-batches, 14 steps, bubble 42.9%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13
rank 0 | 0F0 0F1 0F2 0F3  .   .   .   .   .   .  0B0 0B1 0B2 0B3
rank 1 |  .  1F0 1F1 1F2 1F3  .   .   .   .  1B0 1B1 1B2 1B3  .
rank 2 |  .   .  2F0 2F1 2F2 2F3  .   .  2B0 2B1 2B2 2B3  .   .
rank 3 |  .   .   .  3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3  .   .   .""",
    )


def test_one_f_one_b_table_alternates_after_warmup() -> None:
    assert_expected_inline(
        one_f_one_b(4, 8).table(),
        """\
1f1b: 4 stages on 4 ranks, 8 micro-batches, 22 steps, bubble 27.3%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21
rank 0 | 0F0 0F1 0F2 0F3  .   .   .  0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4  .  0B5  .  0B6  .  0B7
rank 1 |  .  1F0 1F1 1F2  .   .  1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5  .  1B6  .  1B7  .
rank 2 |  .   .  2F0 2F1  .  2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6  .  2B7  .   .
rank 3 |  .   .   .  3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7  .   .   .""",
    )


def test_interleaved_table_places_stage_s_on_rank_s_mod_ranks() -> None:
    assert_expected_inline(
        interleaved_1f1b(2, 2, 4).table(),
        """\
interleaved_1f1b: 4 stages on 2 ranks, 4 micro-batches, 18 steps, bubble 11.1%
step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1  .  2B2  .  2B3 0B2 0B3
rank 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3  .""",
    )


def test_looped_gpipe_table_runs_stages_of_a_rank_one_after_another() -> None:
    assert_expected_inline(
        make_schedule("GPipe", 4, 2, stages_per_rank=2).table(),
        """\
gpipe: 4 stages on 2 ranks, 2 micro-batches, 10 steps, bubble 20.0%
step   |   0   1   2   3   4   5   6   7   8   9
rank 0 | 0F0 0F1 2F0 2F1  .   .  2B0 2B1 0B0 0B1
rank 1 |  .  1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1  .""",
    )


def test_str_of_schedule_is_its_table() -> None:
    schedule = one_f_one_b(2, 2)
    assert str(schedule) == schedule.table()


# --------------------------------------------------------------------------- generated schedules


def _generated_cases() -> list[object]:
    cases: list[object] = []
    for n_stages in range(1, 7):
        for n_mbs in range(1, 10):
            for per_rank in (d for d in range(1, n_stages + 1) if n_stages % d == 0):
                n_ranks = n_stages // per_rank
                names = ["gpipe"]
                if per_rank == 1:
                    names.append("1f1b")
                if per_rank == 1 or n_mbs % n_ranks == 0:
                    names.append("interleaved")
                cases += [
                    pytest.param(
                        name,
                        n_stages,
                        per_rank,
                        n_mbs,
                        id=f"{name}-s{n_stages}-v{per_rank}-m{n_mbs}",
                    )
                    for name in names
                ]
    return cases


@pytest.mark.parametrize(("name", "n_stages", "per_rank", "n_mbs"), _generated_cases())
def test_generated_schedules_validate_without_deadlock(
    name: str, n_stages: int, per_rank: int, n_mbs: int
) -> None:
    schedule = make_schedule(name, n_stages, n_mbs, stages_per_rank=per_rank)
    validate(schedule)  # structure and a deadlock-free simulation
    assert schedule.n_ranks == n_stages // per_rank
    assert schedule.stage_to_rank == tuple(s % schedule.n_ranks for s in range(n_stages))
    for row in schedule.actions:
        position = {action: i for i, action in enumerate(row)}
        for action in row:
            if action.kind == "B":
                assert position[Action("F", action.stage, action.microbatch)] < position[action]
    if n_stages >= 3:  # a skip connection 0 -> 2 on top of the chain
        validate(schedule, {**chain_dependencies(n_stages), 2: {0, 1}})


@pytest.mark.parametrize("n_mbs", range(1, 10))
@pytest.mark.parametrize("n_stages", range(1, 7))
@pytest.mark.parametrize("generator", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_bubble_fraction_is_textbook_value_under_unit_times(
    generator: Callable[[int, int], Schedule], n_stages: int, n_mbs: int
) -> None:
    expected = (n_stages - 1) / (n_mbs + n_stages - 1)  # both sides: one correctly rounded division
    assert simulated_bubble_fraction(generator(n_stages, n_mbs)) == expected


def test_make_schedule_names_are_case_insensitive_with_alias() -> None:
    assert make_schedule("1F1B", 3, 4) == one_f_one_b(3, 4)
    assert make_schedule("Interleaved_1F1B", 4, 4, 2) == make_schedule("interleaved", 4, 4, 2)
    assert make_schedule("interleaved", 4, 4, 2) == interleaved_1f1b(2, 2, 4)


def test_from_lists_parses_compact_strings_and_round_trips() -> None:
    assert Action.parse(" 1b3 ") == Action("B", 1, 3)
    assert str(Action("F", 12, 0)) == "12F0"
    schedule = one_f_one_b(3, 5)
    rebuilt = Schedule.from_lists(3, 5, schedule.stage_to_rank, schedule.to_lists(), name="1f1b")
    assert rebuilt == schedule


# --------------------------------------------------------------------------- dependencies and deadlock

_CROSSED = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]


def test_deadlock_is_reported_as_grid_with_error_markers() -> None:
    schedule = Schedule.from_lists(2, 2, None, _CROSSED, name="crossed")
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert_expected_inline(
        str(info.value),
        """\
schedule 'crossed' deadlocks: at step 1 no rank can run its next action
step   |   0 | pending
rank 0 | 0F0 | 0B0 0F1 0B1   <-- ERROR HERE
rank 1 |  .  | 1F1 1B1 1F0 1B0   <-- ERROR HERE
  rank 0 waits at 0B0 for 1B0, which rank 1 will only run after 1F1
  rank 1 waits at 1F1 for 0F1, which rank 0 will only run after 0B0""",
    )


def test_deadlock_report_names_the_blocking_action_several_steps_in() -> None:
    rows = one_f_one_b(3, 3).to_lists()
    rows[1] = ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]  # no warmup: waits for 2B0 early
    rows[2] = ["2F1", "2B1", "2F0", "2B0", "2F2", "2B2"]  # starts with mb 1, rank 1 sends it late
    schedule = Schedule.from_lists(3, 3, None, rows, name="swapped")
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert_expected_inline(
        str(info.value),
        """\
schedule 'swapped' deadlocks: at step 3 no rank can run its next action
step   |   0   1   2 | pending
rank 0 | 0F0 0F1 0F2 | 0B0 0B1 0B2   <-- ERROR HERE
rank 1 |  .  1F0  .  | 1B0 1F1 1B1 1F2 1B2   <-- ERROR HERE
rank 2 |  .   .   .  | 2F1 2B1 2F0 2B0 2F2 2B2   <-- ERROR HERE
  rank 0 waits at 0B0 for 1B0, at which rank 1 is itself stuck
  rank 1 waits at 1B0 for 2B0, which rank 2 will only run after 2F1
  rank 2 waits at 2F1 for 1F1, which rank 1 will only run after 1B0""",
    )


def test_dependencies_decide_whether_a_schedule_deadlocks() -> None:
    schedule = Schedule.from_lists(2, 2, None, _CROSSED)
    validate(schedule, dependencies={})  # independent stages: nothing to wait for
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(schedule)  # default chain 0 -> 1


def test_skip_connections_keep_generated_schedules_valid() -> None:
    skip = {1: {0}, 2: {0, 1}}
    assert simulated_bubble_fraction(one_f_one_b(3, 4), skip) == simulated_bubble_fraction(one_f_one_b(3, 4))
    validate(interleaved_1f1b(2, 2, 2), {**chain_dependencies(4), 3: {0, 2}})


# --------------------------------------------------------------------------- invalid input


def _custom(
    rows: list[list[str]],
    stage_to_rank: list[int] | None = None,
    dependencies: dict[int, set[int]] | None = None,
) -> None:
    validate(Schedule.from_lists(2, 2, stage_to_rank, rows), dependencies)


_GOOD = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]

# fmt: off
INVALID = [
    pytest.param(lambda: _custom([_GOOD[0] + ["5F0"], _GOOD[1]]), "refers to stage 5, but stages are 0..1", id="unknown-stage"),
    pytest.param(lambda: _custom([_GOOD[0] + ["0F7"], _GOOD[1]]), "refers to micro-batch 7", id="unknown-microbatch"),
    pytest.param(lambda: _custom([_GOOD[0][:-1], _GOOD[1]]), "missing 1 action(s): 0B1", id="missing-backward"),
    pytest.param(lambda: _custom([_GOOD[0], _GOOD[1] + ["1F0"]]), "1F0 appears 2 times (rank 1 position 0, rank 1 position 4)", id="duplicate"),
    pytest.param(lambda: _custom([_GOOD[0] + ["1F0"], _GOOD[1][1:]]), "1F0 runs stage 1, which stage_to_rank puts on rank 1", id="wrong-rank"),
    pytest.param(lambda: _custom([["0B0", "0F0", "0F1", "0B1"], _GOOD[1]]), "rank 0 runs 0B0 (position 0) before its forward 0F0 (position 1)", id="backward-before-forward"),
    pytest.param(lambda: _custom(_GOOD, [0]), "stage_to_rank has 1 entries but n_stages=2", id="stage-to-rank-length"),
    pytest.param(lambda: _custom(_GOOD, [0, 3]), "puts stage 1 on rank 3, but there are 2 ranks", id="stage-to-rank-out-of-range"),
    pytest.param(lambda: _custom(_GOOD, dependencies={1: {4}}), "stage 1 the producer 4", id="dependency-unknown-stage"),
    pytest.param(lambda: _custom([["0F0", "0X0", "F1"], []]), "position 2: cannot parse action 'F1'", id="unparsable-action"),
    pytest.param(lambda: Action("X", 0, 0), 'kind must be "F", "B", "I" or "W"', id="unknown-action-kind"),
    pytest.param(lambda: make_schedule("zigzag", 4, 4), "valid names: 'gpipe', '1f1b', 'interleaved'", id="unknown-name"),
    pytest.param(lambda: make_schedule("1f1b", 4, 4, 2), "use 'interleaved'", id="1f1b-several-stages-per-rank"),
    pytest.param(lambda: make_schedule("gpipe", 5, 4, 2), "(n_stages=5, stages_per_rank=2)", id="stages-not-multiple"),
    pytest.param(lambda: interleaved_1f1b(2, 2, 5), "(n_microbatches=5, n_ranks=2, stages_per_rank=2); use 4 or 6", id="interleaved-microbatches"),
    pytest.param(lambda: one_f_one_b(0, 4), "positive integers (n_stages=0)", id="non-positive-size"),
]
# fmt: on


@pytest.mark.parametrize(("build", "message"), INVALID)
def test_invalid_schedule_or_arguments_raise_schedule_error(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        build()
    assert message in str(info.value)


def test_every_problem_is_reported_at_once() -> None:
    rows = [["0B0", "0F0", "0F1", "9B1"], ["1F0", "1B0", "1F1"]]
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_lists(2, 2, None, rows, name="messy"))
    assert_expected_inline(
        str(info.value),
        """\
schedule 'messy' is invalid (3 problem(s)):
  - rank 0, position 3: 9B1 refers to stage 9, but stages are 0..1
  - missing 2 action(s): 0B1 1B1 (every stage runs one F and one B per micro-batch)
  - rank 0 runs 0B0 (position 0) before its forward 0F0 (position 1); move the F earlier
(the deadlock check runs once these are fixed)""",
    )
