"""Fault recovery: after a rank raises, hangs or dies, how soon does the next task finish?

    python benchmarks/bench_recovery.py [--world-size 4] [--rounds 5]

On a warm World, each round makes one rank raise (the others wait in a collective), hang past a
2 s timeout, or die (SIGKILL); the World reports it and stops its ranks. Timed: from the moment
the fault's error reaches the caller to the end of the next task (an all-reduce on every rank),
i.e. the restart. Ranks start from a forkserver that imported torch once (pipecheck's default on
Linux); ``--start-method spawn`` measures a full spawn for comparison. Results go to the "Fault
recovery" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

try:
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, median, write_section

TARGET_S = 3.0


def all_reduce(ctx: Any) -> float:
    value = torch.ones(1)
    dist.all_reduce(value, group=ctx.group)
    return float(value.item())


def raises(ctx: Any) -> None:
    if ctx.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier(group=ctx.group)  # the other ranks wait for it


def hangs(ctx: Any) -> None:
    if ctx.rank == 1:
        while True:
            time.sleep(0.05)


def dies(ctx: Any) -> None:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier(group=ctx.group)


def recovery_times(world_size: int, rounds: int) -> dict[str, list[float]]:
    import pipecheck as pc

    times: dict[str, list[float]] = {"raise": [], "hang": [], "die": []}
    with pc.World(world_size, timeout=60) as world:
        world.run(all_reduce)  # warm: the forkserver and the first ranks are up
        for _ in range(rounds):
            for kind, fault, timeout in (("raise", raises, 60.0), ("hang", hangs, 2.0), ("die", dies, 60.0)):
                try:
                    world.run(fault, timeout=timeout)
                except pc.WorldError:
                    pass
                started = time.perf_counter()
                assert world.run(all_reduce) == [float(world_size)] * world_size
                times[kind].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--start-method", choices=("forkserver", "spawn"), default=None)
    opts = parser.parse_args()
    if opts.start_method:
        os.environ["PIPECHECK_START_METHOD"] = opts.start_method
    times = recovery_times(opts.world_size, opts.rounds)
    method = opts.start_method or "forkserver (default)"
    command = (f"python benchmarks/bench_recovery.py --world-size {opts.world_size} --rounds {opts.rounds}"
               + (f" --start-method {opts.start_method}" if opts.start_method else ""))
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
        "",
        f"World of {opts.world_size} CPU ranks, start method {method}. Time from the fault's error to the end "
        f"of the next task (the World stops every rank, starts fresh ones, and runs an all-reduce), "
        f"{opts.rounds} rounds:",
        "",
        "| fault | median | max | target |",
        "| --- | --- | --- | --- |",
        *[f"| rank {kind}s | {median(values):.2f} s | {max(values):.2f} s | <= {TARGET_S:.0f} s: "
          f"{'met' if max(values) <= TARGET_S else 'NOT met'} |" for kind, values in times.items()],
    ]
    write_section(f"Fault recovery ({method})", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
