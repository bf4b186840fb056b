"""The one table of schedule names: every runner and the command line read the same rows."""

from __future__ import annotations

import pytest

import pipecheck as pc

# private: torchtitan's runner reads the same table of schedule names (its names and its V placement)
from pipecheck._runners.torchtitan.driver import stage_owner, titan_schedule
from pipecheck._schedule.names import SCHEDULES, name_key, schedule_named
from pipecheck._schedule.torch_classes import ALIASES, TORCH_SCHEDULES
from pipecheck.schedules import SCHEDULE_NAMES, make_schedule, stages_per_rank_of

SPELLINGS = [(spelling, entry.key) for entry in SCHEDULES.values() for spelling in (entry.key, *entry.spellings)]


@pytest.mark.parametrize("spelling,key", SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_every_spelling_names_one_row_for_every_runner(spelling: str, key: str) -> None:
    shouted = spelling.upper().replace("_", "-")
    assert schedule_named(shouted) is SCHEDULES[key] and name_key(f" {shouted} ") == spelling
    assert ALIASES[spelling] == key  # torch runs every row
    assert titan_schedule(shouted, 1) == SCHEDULES[key].torchtitan
    if SCHEDULES[key].pipecheck:
        built = make_schedule(shouted, 4, 4, stages_per_rank_of(spelling) or 2)
        assert built.name == {"interleaved": "interleaved_1f1b"}.get(key, key)
    else:
        with pytest.raises(pc.ScheduleError, match="run it with runner='torch'"):
            make_schedule(shouted, 4, 4, 2)


def test_pipecheck_s_runtime_builds_exactly_the_rows_marked_so() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zb", "zbv")
    assert set(TORCH_SCHEDULES) == set(SCHEDULES)


def test_the_v_placement_is_read_from_the_table() -> None:
    v_shaped = {entry.torchtitan for entry in SCHEDULES.values() if entry.placement == "v"}
    assert v_shaped == {"ZBVZeroBubble", "DualPipeV"}
    assert [stage_owner(s, 4, 2, "ZBVZeroBubble") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_owner(s, 4, 2, "Interleaved1F1B") for s in range(4)] == [0, 1, 0, 1]
    assert titan_schedule("gpipe", 2) == "LoopedBFS"  # torch's GPipe order with several stages per rank
