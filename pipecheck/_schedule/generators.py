"""The schedules pipecheck's runtime runs, generated as data (re-exported by ``pipecheck.schedules``).

    gpipe(4, 8)                # all forwards, then all backwards
    one_f_one_b(4, 8)          # 1F1B
    interleaved_1f1b(2, 2, 4)  # Megatron's interleaved 1F1B, 2 stages per rank
    zero_bubble_h1(4, 8)       # ZB-H1: 1F1B with each backward split into I and a later W
    zbv(2, 4)                  # ZB-V: 2 stages per rank in a V, backward split into I and W

ZB-H1 on 3 ranks with 4 micro-batches (``print(zero_bubble_h1(3, 4).table())``,
unit times): rank ``r`` runs 1F1B with ``I`` in place of ``B`` and defers each
``W`` by ``r`` micro-batches, so the weight gradients fill the cool-down bubble::

    step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13
    rank 0 | 0F0 0F1 0F2  .   .  0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
    rank 1 |  .  1F0 1F1  .  1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
    rank 2 |  .   .  2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3

The two zero-bubble orders are torch.distributed.pipelining's
(``ScheduleInterleavedZeroBubble`` with one stage per rank, and
``ScheduleZBVZeroBubble``), action for action; the tests compare them. Each
stage's ``W`` actions run in micro-batch order, so weight gradients accumulate
in the order of every other schedule (bitwise equal results).
"""

from __future__ import annotations

from pipecheck._schedule.data import (
    Action,
    Schedule,
    check_positive,
    ranks_for,
    round_robin,
    v_shape,
)
from pipecheck.errors import ScheduleError


def gpipe(n_stages: int, n_microbatches: int, *, stages_per_rank: int = 1) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order 0..m-1 (as torch's ScheduleGPipe).

    With ``stages_per_rank > 1`` stages are laid round-robin (stage ``s`` on
    rank ``s % n_ranks``) and each rank runs its stages one after another
    ("looped BFS"): forwards stage by stage, backwards in reverse stage order.
    """
    check_positive(n_stages=n_stages, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank)
    n_ranks = ranks_for(n_stages, stages_per_rank)
    mbs = range(n_microbatches)
    rows = []
    for rank in range(n_ranks):
        own = range(rank, n_stages, n_ranks)
        forwards = [Action("F", stage, mb) for stage in own for mb in mbs]
        backwards = [Action("B", stage, mb) for stage in reversed(own) for mb in mbs]
        rows.append(tuple(forwards + backwards))
    return Schedule(n_stages, n_microbatches, round_robin(n_stages, n_ranks), tuple(rows), "gpipe")


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush), one stage per rank: warmup, steady one-forward-one-backward, cooldown.

    Rank ``r`` first runs ``min(n_stages - r - 1, n_microbatches)`` forwards.
    """
    check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    rows = []
    for rank in range(n_stages):
        warmup = min(n_stages - rank - 1, n_microbatches)
        ops = [Action("F", rank, mb) for mb in range(warmup)]
        for i in range(n_microbatches - warmup):
            ops += [Action("F", rank, warmup + i), Action("B", rank, i)]
        ops += [Action("B", rank, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        rows.append(tuple(ops))
    return Schedule(n_stages, n_microbatches, tuple(range(n_stages)), tuple(rows), "1f1b")


def interleaved_1f1b(n_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``stages_per_rank`` virtual stages per rank.

    Stage ``s`` lives on rank ``s % n_ranks``. Micro-batches move through a
    rank's stages in groups of ``n_ranks`` (depth first); rank ``r`` warms up
    with ``2 * (n_ranks - r - 1) + (stages_per_rank - 1) * n_ranks`` forwards.
    With more than one stage per rank, ``n_microbatches`` must be a multiple
    of ``n_ranks`` (Megatron's rule); with one, any count works and the
    warmup is twice 1F1B's (the formula above with ``stages_per_rank=1``).
    """
    check_positive(n_ranks=n_ranks, stages_per_rank=stages_per_rank, n_microbatches=n_microbatches)
    if stages_per_rank > 1 and n_microbatches % n_ranks:
        lower = n_microbatches - n_microbatches % n_ranks
        fix = f"{lower} or {lower + n_ranks}" if lower else f"{n_ranks}"
        raise ScheduleError(
            "interleaved 1F1B needs n_microbatches to be a multiple of n_ranks "
            f"(n_microbatches={n_microbatches}, n_ranks={n_ranks}, stages_per_rank={stages_per_rank}); "
            f"use {fix} micro-batches, or the 'gpipe' schedule"
        )
    p, v = n_ranks, stages_per_rank
    total = v * n_microbatches  # actions of each kind per rank

    def action(kind: str, k: int, rank: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    rows = []
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        ops = [action("F", k, rank) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [action("F", warmup + i, rank), action("B", i, rank)]
        ops += [action("B", k, rank) for k in range(total - warmup, total)]
        rows.append(tuple(ops))
    n_stages = p * v
    return Schedule(n_stages, n_microbatches, round_robin(n_stages, p), tuple(rows), "interleaved_1f1b")


def zero_bubble_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024), one stage per rank.

    1F1B with every backward split: ``I`` (input gradients, sent upstream at
    once) where 1F1B runs ``B``, and the matching ``W`` (weight gradients)
    deferred by ``r`` micro-batches on rank ``r``, then flushed in micro-batch
    order at the end. With F, I and W of equal cost its bubble is a third of
    1F1B's, at the same peak memory (rank ``r`` holds at most ``r`` pending W).
    """
    check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    m = n_microbatches
    rows = []
    for rank in range(n_stages):
        warmup = min(n_stages - rank - 1, m)
        ops = [Action("F", rank, mb) for mb in range(warmup)]
        for k in range(m):
            if k < m - warmup:
                ops.append(Action("F", rank, warmup + k))
            ops.append(Action("I", rank, k))
            if k >= rank:
                ops.append(Action("W", rank, k - rank))
        ops += [Action("W", rank, mb) for mb in range(max(0, m - rank), m)]
        rows.append(tuple(ops))
    return Schedule(n_stages, m, tuple(range(n_stages)), tuple(rows), "zb")


def zbv(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. §6): ``2 * n_ranks`` stages in a V, stage ``r`` and ``2p - 1 - r`` on rank ``r``.

    The micro-batches run down the ranks through the first half of the
    stages and back up through the second, so rank 0 holds the first and the
    last stage and the turn (stages ``p - 1`` and ``p``) stays on rank
    ``p - 1``. Rank ``r`` warms up with ``2(p - r) - 1`` forwards of its first
    stage, ``r`` forward pairs and ``p - r`` forward-I-W triples of its second
    stage; in the steady phase it alternates F, I, W of each of its two
    stages; in the cool-down it runs the remaining I and then the W. As
    torch does, the order is planned for ``max(2p - 1, m)`` micro-batches and
    the actions of the missing ones are left out.
    """
    check_positive(n_ranks=n_ranks, n_microbatches=n_microbatches)
    p, m = n_ranks, n_microbatches
    rows = [tuple(a for a in _zbv_rank(p, rank, max(2 * p - 1, m)) if a.microbatch < m) for rank in range(p)]
    return Schedule(2 * p, m, v_shape(p), tuple(rows), "zbv")


def _zbv_rank(p: int, rank: int, planned: int) -> list[Action]:
    """Rank ``rank``'s ZB-V actions for ``planned`` micro-batches (torch's
    ``ScheduleZBVZeroBubble._calculate_single_rank_operations``, without its idle slots)."""
    down, up = rank, 2 * p - 1 - rank  # this rank's stage on the way down and on the way up
    ops: list[Action] = []
    count = {(kind, stage): 0 for kind in "FIW" for stage in (down, up)}  # next micro-batch of each

    def run(kind: str, stage: int) -> None:
        ops.append(Action(kind, stage, count[(kind, stage)]))
        count[(kind, stage)] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F", down)
    for _ in range(rank):
        run("F", up)
        run("F", down)
    for _ in range(p - rank):
        run("F", up)
        run("I", up)
        run("W", up)
    while count[("F", up)] < count[("F", down)] or count[("F", down)] < planned:
        if count[("F", down)] < planned:
            run("F", down)
        run("I", down)
        run("W", down)
        run("F", up)
        run("I", up)
        run("W", up)
    for _ in range(rank):
        run("I", down)
        run("I", up)
    for _ in range(p - rank):
        run("I", down)
        run("W", down)
    while count[("W", up)] < count[("I", up)]:
        run("W", up)
    while count[("W", down)] < count[("I", down)]:
        run("W", down)
    return ops
