"""Each rank's peak memory in a distributed check: ranks build only their own stages (issue 34).

    python benchmarks/bench_stage_build.py [--d 512] [--ranks 4] [--rounds 3]

Checks benchmarks/_gpt.py's GPT, cut into ``--ranks`` stages (one a rank), with ``runner="distributed"``
on a fresh World, then asks every rank for its peak resident memory (``VmHWM`` in /proc/self/status:
the World's start, the warm-up check and the timed ones) and for what it holds now; the driver's own
peak too. The check's time is the median of ``--rounds`` after a warm-up. Run it with
``PYTHONPATH`` naming another checkout to measure that one: the numbers go to the standard output only.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch

import pipecheck as pc

try:
    from _gpt import GPT, GPTConfig, gpt_inputs, lm_loss
except ImportError:  # run as a module from the repo root
    from benchmarks._gpt import GPT, GPTConfig, gpt_inputs, lm_loss


def status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB (``VmHWM``: the peak resident memory; ``VmRSS``: now)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def rank_memory(ctx: Any) -> tuple[int, int]:
    """A World job: this rank's (peak, current) resident memory in KiB."""
    return status_kib("VmHWM"), status_kib("VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    opts = parser.parse_args()
    config = GPTConfig(d=opts.d, blocks=8, vocab=2048, seq=64, stages=opts.ranks)
    factory = functools.partial(GPT, config)
    ids, target = gpt_inputs(config, opts.batch)
    size = sum(p.numel() * p.element_size() for p in factory().parameters())
    times = []
    with pc.World(opts.ranks, threads_per_rank=1) as world:
        check = functools.partial(pc.assert_equivalent, factory, (ids,), runner="distributed", loss_fn=lm_loss,
                                  target=target, n_microbatches=opts.ranks, world=world)
        check()  # warm-up: imports, the World's first task
        for _ in range(opts.rounds):
            started = time.perf_counter()
            check()
            times.append(time.perf_counter() - started)
        memory = world.run(rank_memory)
    print(f"pipecheck from {pc.__file__}")
    print(f"GPT d={config.d}, {config.blocks} blocks, vocab {config.vocab}: parameters {size / 2**20:.0f} MiB; "
          f"{opts.ranks} ranks, one stage each")
    print(f"check: median {statistics.median(times):.3f} s of {opts.rounds} ({', '.join(f'{t:.3f}' for t in times)})")
    for rank, (peak, now) in enumerate(memory):
        print(f"rank {rank}: VmHWM {peak / 1024:.0f} MiB, VmRSS {now / 1024:.0f} MiB")
    print(f"ranks' peaks summed: {sum(peak for peak, _ in memory) / 1024:.0f} MiB; driver VmHWM "
          f"{status_kib('VmHWM') / 1024:.0f} MiB")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
