"""Soak: many warm checks on one World, for latency outliers and memory that grows with each check.

    python benchmarks/soak.py [--checks 500] [--every 100] [--tracemalloc] [--no-write]

``assert_equivalent`` of zoo ``mlp`` (4 stages, 4 micro-batches, runner "distributed", fp64 ground
truth included) --checks times on one ``pc.World(4)``, after one warm-up check (the ranks' first job
imports). Records each check's latency (p50, p99, max; and p50 of the first and last 100, which
should not drift) and, at the start, every --every checks and at the end: the driver's RSS, each
rank's RSS (from /proc), and the size of every cache that could grow per check, on the driver and
on the ranks (pipecheck's own and torch.fx's per-GraphModule source cache). Targets: no growth
beyond noise; p99 <= 3x p50 on a quiet machine. --tracemalloc runs the checks again under
tracemalloc and prints the driver's 15 largest allocation sites grown between the 100th and the
last check (slower: not the latency run). Results go to the "Soak" section of benchmarks/RESULTS.md
unless --no-write.
"""

from __future__ import annotations

import argparse
import gc
import linecache
import os
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.graph_module
from pipecheck.fixtures import get

import pipecheck as pc

try:
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, write_section

RANKS, MICROBATCHES = 4, 4


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident set size from /proc (None where /proc cannot be read: not Linux, another user)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cache_sizes() -> dict[str, int]:
    """Entries in each cache a check may add to, in this process."""
    # private: the runtime's communication is what the soak watches for leaks
    from pipecheck._runtime import comm as _comm
    from pipecheck._runtime import stage_step as _stage_step

    return {
        "pipecheck._runtime.comm._spec (lru, max 1024)": _comm._spec.cache_info().currsize,
        "pipecheck._runtime.stage_step._TRAINABLE (weak)": len(_stage_step._TRAINABLE),
        "torch.fx _loader.eval_cache": len(torch.fx.graph_module._loader.eval_cache),
        "linecache.cache": len(linecache.cache),
        "gc objects": len(gc.get_objects()),
    }


def rank_probe(ctx: Any) -> dict[str, int]:
    """Run on each rank: its caches, after a collection."""
    gc.collect()
    return cache_sizes()


@dataclass
class Sample:
    checks: int
    driver_mib: float | None
    rank_mib: list[float | None]
    driver_caches: dict[str, int]
    rank_caches: list[dict[str, int]] = field(default_factory=list)


def sample(checks: int, world: pc.World) -> Sample:
    gc.collect()
    return Sample(checks, rss_mib(), [rss_mib(pid) for pid in world.pids], cache_sizes(),
                  world.run(rank_probe))


def run_checks(n_checks: int, every: int, world: pc.World, on_sample: Any = None) -> tuple[list[float], list[Sample]]:
    entry = get("mlp")
    args, kwargs = entry.inputs()

    def check() -> float:
        started = time.perf_counter()
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="distributed", n_microbatches=MICROBATCHES,
                             world=world)
        return time.perf_counter() - started

    check()  # the ranks' first job imports
    samples = [sample(0, world)]
    latencies = []
    for i in range(1, n_checks + 1):
        latencies.append(check())
        if i % every == 0 or i == n_checks:
            samples.append(sample(i, world))
            if on_sample is not None:
                on_sample(i)
    return latencies, samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]  # nearest rank


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def report(n_checks: int, every: int, latencies: list[float], samples: list[Sample], command: str) -> str:
    p50, p99, worst = percentile(latencies, 50), percentile(latencies, 99), max(latencies)
    block = min(100, len(latencies))
    first, last = statistics.median(latencies[:block]), statistics.median(latencies[-block:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average {load} at the end (the machine is shared: other engineers' "
        "tests run on the same 2 cores, so latency outliers include time waiting for a core)",
        "",
        f"`assert_equivalent` of zoo `mlp` ({RANKS} stages on {RANKS} ranks, {MICROBATCHES} micro-batches, runner "
        f"'distributed', fp64 ground truth included), {n_checks} checks on one `pc.World({RANKS})` after one "
        "warm-up check. RSS from /proc after gc.collect(), in MiB.",
        "",
        "| checks | p50 | p99 | max | p99/p50 | p50 first 100 | p50 last 100 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {n_checks} | {p50 * 1e3:.0f} ms | {p99 * 1e3:.0f} ms | {worst * 1e3:.0f} ms | {p99 / p50:.2f} | "
        f"{first * 1e3:.0f} ms | {last * 1e3:.0f} ms |",
        "",
        "| after check | p50 since the last row | driver RSS | ranks' RSS | "
        + " | ".join(f"driver {k}" for k in samples[0].driver_caches) + " |",
        "| ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in samples[0].driver_caches) + " |",
    ]
    for previous, s in zip([None, *samples], samples):
        since = latencies[previous.checks:s.checks] if previous is not None else []
        p50_since = f"{statistics.median(since) * 1e3:.0f} ms" if since else "-"
        lines.append(f"| {s.checks} | {p50_since} | {_mib(s.driver_mib)} | {', '.join(_mib(r) for r in s.rank_mib)} | "
                     + " | ".join(str(v) for v in s.driver_caches.values()) + " |")
    lines += ["", "Caches on the ranks (rank 0 .. 3), at the start and at the end:", "",
              "| cache | start | end |", "| --- | --- | --- |"]
    for key in samples[0].rank_caches[0]:
        start = ", ".join(str(c[key]) for c in samples[0].rank_caches)
        end = ", ".join(str(c[key]) for c in samples[-1].rank_caches)
        lines.append(f"| {key} | {start} | {end} |")
    lines += ["", f"- p99 <= 3x p50: **{'met' if p99 <= 3 * p50 else 'NOT met'}** (p99/p50 {p99 / p50:.2f})."]
    settled = next((s for s in samples if s.checks >= every), samples[0])  # the first checks warm caches up
    span = samples[-1].checks - settled.checks
    if span and settled.driver_mib is not None and samples[-1].driver_mib is not None:
        driver = samples[-1].driver_mib - settled.driver_mib
        ranks = [f"{end - start:+.1f}" if start is not None and end is not None else "n/a"
                 for start, end in zip(settled.rank_mib, samples[-1].rank_mib)]
        lines.append(f"- RSS from check {settled.checks} to {samples[-1].checks}: driver {driver:+.1f} MiB "
                     f"({driver * 1024 / span:+.1f} KiB per check), ranks {', '.join(ranks)} MiB.")
    return "\n".join(lines)


def tracemalloc_diff(n_checks: int, every: int, top: int = 15) -> str:
    """The driver's allocation sites that grew between the ``every``-th check and the last."""
    tracemalloc.start(10)
    snapshots: dict[int, tracemalloc.Snapshot] = {}

    def take(i: int) -> None:
        if i == every or i == n_checks:
            gc.collect()
            snapshots[i] = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])

    with pc.World(RANKS) as world:
        run_checks(n_checks, every, world, take)
    tracemalloc.stop()
    stats = snapshots[n_checks].compare_to(snapshots[every], "traceback")
    lines = [f"tracemalloc, driver, check {every} -> {n_checks}: "
             f"{sum(s.size_diff for s in stats) / 1024:+.0f} KiB in all; largest growth:"]
    for stat in stats[:top]:
        frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in stat.traceback[-4:]]
        lines.append(f"  {stat.size_diff / 1024:+8.1f} KiB {stat.count_diff:+6d} blocks  " + " <- ".join(frames[::-1]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=500, help="warm checks to run (after one warm-up)")
    parser.add_argument("--every", type=int, default=100, help="sample RSS and caches every N checks")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="then run again under tracemalloc and print the driver's growth by site")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    opts = parser.parse_args()
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    with pc.World(RANKS) as world:
        latencies, samples = run_checks(opts.checks, opts.every, world)
    text = report(opts.checks, opts.every, latencies, samples, command.strip())
    if opts.tracemalloc:
        text += "\n\n```\n" + tracemalloc_diff(opts.checks, opts.every) + "\n```"
    print(text)
    if not opts.no_write:
        write_section("Soak (warm checks on one World: latency and memory)", text)


if __name__ == "__main__":
    main()
