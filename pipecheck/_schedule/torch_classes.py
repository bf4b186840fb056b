"""torch.distributed.pipelining's schedules as runner="torch" drives them: names, placement, layout rules.

    layout = torch_layout("zbv", n_stages=4, n_microbatches=4, stages_per_rank=2)
    layout.class_name, layout.stage_to_rank      # "ScheduleZBVZeroBubble", (0, 1, 1, 0)

torch's own ``get_schedule_class`` knows nine CamelCase names and no
snake_case ones; runner="torch" takes pipecheck's names ("gpipe", "1f1b",
"interleaved", "zb", "interleaved_zb", "zbv", "dualpipev", "looped_bfs"),
torch's short names ("ZBVZeroBubble") and its class names
("ScheduleZBVZeroBubble"), case-insensitively.

torch checks few layouts itself, and some only deep inside a rank: ZB-V on
stages placed in a loop instead of a V is accepted and then crashes a rank
with a huge allocation. So every rule is checked here, on the driver, before
any rank starts, and all problems are reported at once with the fix:

========================  ==========  ===============  =========================================
schedule                  placement   stages per rank  micro-batches (m) on p ranks
========================  ==========  ===============  =========================================
gpipe, looped_bfs         loop        any              any (gpipe on torch 2.10: m >= stages)
1f1b                      loop        1                m >= number of stages
interleaved               loop        any              m a multiple of max(1, m // p)
zb (ZB-H1)                loop        1                m a multiple of max(1, m // p)
interleaved_zb            loop        any              m a multiple of max(1, m // p)
zbv                       V           2                any
dualpipev                 V           2                m >= number of stages
========================  ==========  ===============  =========================================

V placement: stage ``r`` and stage ``2p - 1 - r`` on rank ``r``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipecheck._core.torch_versions import at_least, tested_note
from pipecheck._schedule.data import round_robin, v_shape
from pipecheck._schedule.names import SCHEDULES, ScheduleName, name_key
from pipecheck._schedule.sim import problem_list
from pipecheck.errors import AdapterError, ScheduleError

ENGINE = "torch.distributed.pipelining"


# torch's schedules: the rows of pipecheck's one table of schedule names that torch runs (all of them).
TORCH_SCHEDULES = {key: entry for key, entry in SCHEDULES.items() if entry.torch_single or entry.torch_multi}

# Every accepted name, as name_key gives it, -> its key: pipecheck's names, torch's short names
# (get_schedule_class) and torch's class names.
ALIASES = {spelling: entry.key for entry in TORCH_SCHEDULES.values() for spelling in (entry.key, *entry.spellings)}


@dataclass(frozen=True)
class TorchLayout:
    """How one check runs a torch schedule: its key, torch's class, and the rank of every stage."""

    key: str
    class_name: str
    stage_to_rank: tuple[int, ...]


def torch_layout(name: str, n_stages: int, n_microbatches: int, stages_per_rank: int) -> TorchLayout:
    """The layout of ``name`` for a split of ``n_stages``; ScheduleError listing every rule it breaks."""
    import torch  # here: the names above are read without torch (the command line checks them)

    key = ALIASES.get(name_key(name))
    if key is None:
        raise ScheduleError(
            f"unknown schedule {name!r} for runner='torch'; valid names: "
            + ", ".join(repr(k) for k in TORCH_SCHEDULES)
            + " (case-insensitive), or torch's class names such as 'ScheduleZBVZeroBubble' / 'ZBVZeroBubble'"
        )
    schedule = TORCH_SCHEDULES[key]
    if stages_per_rank == 1 and schedule.torch_single is not None and not at_least(torch.__version__, "2.11"):
        # torch 2.10's PipelineScheduleSingle refuses m < stages for every schedule, ScheduleGPipe too;
        # from 2.11 only Schedule1F1B does (measured on 2.10 to 2.15, test_layout_rules_accept_exactly_...)
        schedule = dataclasses.replace(schedule, torch_rule="stages")
    problems = _layout_problems(schedule, n_stages, n_microbatches, stages_per_rank)
    if problems:
        raise ScheduleError(problem_list(f"runner='torch' cannot run schedule {name!r} ({key}) on this split",
                                         problems))
    n_ranks = n_stages // stages_per_rank
    single = stages_per_rank == 1 and schedule.torch_single is not None
    class_name = str(schedule.torch_single if single else schedule.torch_multi)
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules, class_name):  # every tested torch has every class in the table above
        raise AdapterError(f"torch {torch.__version__} has no {class_name} (schedule {name!r}), which "
                           f"pipecheck's table of torch's schedules names; {tested_note(torch.__version__)}. "
                           "Fix: install a tested torch, or use another schedule.", engine=ENGINE)
    placement = v_shape(n_ranks) if schedule.placement == "v" else round_robin(n_stages, n_ranks)
    return TorchLayout(key, class_name, placement)


def _layout_problems(schedule: ScheduleName, n_stages: int, n_mbs: int, per_rank: int) -> list[str]:
    problems = [f"{name} must be a positive integer ({name}={value!r})"
                for name, value in (("n_stages", n_stages), ("n_microbatches", n_mbs),
                                    ("stages_per_rank", per_rank)) if type(value) is not int or value < 1]
    if problems:
        return problems
    what = f"torch's {schedule.torch_single if per_rank == 1 and schedule.torch_single else schedule.torch_multi or schedule.torch_single}"
    if schedule.stages_per_rank is not None and per_rank != schedule.stages_per_rank:
        if schedule.placement == "v":
            problems.append(f"{what} places exactly 2 stages on each rank, in a V (stage r and "
                            f"n_stages - 1 - r on rank r), but stages_per_rank={per_rank}; pass stages_per_rank=2")
        else:
            other = "'interleaved_zb'" if schedule.key == "zb" else "'interleaved'"
            problems.append(f"'{schedule.key}' runs one stage per rank (stages_per_rank={per_rank}); "
                            f"use {other} for several stages per rank, or stages_per_rank=1")
    if n_stages % per_rank:
        problems.append(f"n_stages={n_stages} is not a multiple of stages_per_rank={per_rank}; cut the model "
                        f"into a multiple of {per_rank} stages")
        return problems
    n_ranks = n_stages // per_rank
    if schedule.torch_rule == "stages" and n_mbs < n_stages:
        problems.append(f"{what} needs at least as many micro-batches as stages (n_microbatches={n_mbs}, "
                        f"{n_stages} stages); use n_microbatches={n_stages} or more")
    if schedule.torch_rule == "rounds" and n_mbs % max(1, n_mbs // n_ranks):
        fits = [m for m in range(max(1, n_mbs - n_ranks), n_mbs + 2 * n_ranks) if m % max(1, m // n_ranks) == 0]
        lower, higher = max(m for m in fits if m < n_mbs), min(m for m in fits if m > n_mbs)
        problems.append(f"{what} needs n_microbatches to be a multiple of its number of rounds, "
                        f"max(1, n_microbatches // ranks) = {n_mbs // n_ranks} (n_microbatches={n_mbs}, "
                        f"{n_ranks} ranks); use {lower} or {higher}")
    return problems


def v_warmup_patch(stage: Any, rank: int) -> None:
    """Drop the p2p warm-up messages ``stage`` would send to or receive from its own rank.

    torch's ``_PipelineStage`` (what ``pipeline()`` + ``build_stage`` make) warms up its links by
    exchanging a dummy tensor with the neighbour stages' ranks, even when a neighbour is on the same
    rank (the turn of a V: stages p - 1 and p on rank p - 1); gloo then fails with "Pair is not
    connected". Those messages carry nothing (same-rank stages pass tensors locally), so they are
    dropped. This wraps a private method on torch's stage object of this step, never the user's model.

    Keyed by a feature probe, not a version: torch up to 2.14 has the warm-up
    (``_get_init_p2p_neighbors_ops``) and its bug; 2.15 has no warm-up, so there is nothing to drop.
    The torch version matrix (docs/torch-versions.md) runs zbv and dualpipev on every torch it lists.
    """
    original = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if original is None:  # no warm-up exchange (torch >= 2.15): nothing is sent to the stage's own rank
        return

    def without_self_messages() -> list[object]:
        return [op for op in original() if getattr(op, "group_peer", None) != rank]

    stage._get_init_p2p_neighbors_ops = without_self_messages
