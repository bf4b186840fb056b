"""Generated pipeline checks per second, and what a run of generated cases exercised.

    python benchmarks/bench_strategies.py [--cases 200] [--distributed-cases 100]
    python benchmarks/bench_strategies.py --feature-counts counts.jsonl [--wall-s 612 --command "..."]

(a) Throughput: a hypothesis test over ``pst.pipeline_cases()`` runs ``case.check(runner)``
    for N generated cases (generate phase only, derandomized), timed end to end: drawing the
    case, building the model, the eager fp32 and fp64 runs, the runner, the comparison.
    Reference runner in fp32; distributed runner in fp32 on warm Worlds (one per world size,
    started before timing). Written to the "Strategies (generated cases per second)" section of
    benchmarks/RESULTS.md.
(b) ``--feature-counts PATH`` summarises the JSON lines that tests/strategies/test_properties.py appends
    when ``PIPECHECK_FEATURE_COUNTS=PATH`` is set: cases per test, and per feature (the model's
    ``features(spec)`` and the split's ``CROSSINGS``) how many cases exercised it. With
    ``--wall-s`` and ``--command`` it is also written to RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings

import pipecheck as pc
from pipecheck import strategies as pst

try:
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, write_section

TARGETS = {"reference": 30.0, "distributed": 4.0}


def cases_per_second(runner: str, n_cases: int) -> tuple[float, float]:
    """(cases per second, seconds) over ``n_cases`` generated cases, end to end."""
    done = [0]
    strategy = pst.pipeline_cases(runners=(runner,))

    @settings(max_examples=n_cases, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(case: pst.PipelineCase) -> None:
        extra: dict[str, Any] = {}
        if runner == "distributed":
            extra["world"] = pc.World.shared(case.world_size)
        case.check(**extra)
        done[0] += 1

    started = time.perf_counter()
    check()
    seconds = time.perf_counter() - started
    return done[0] / seconds, seconds


def warm_worlds(max_world_size: int) -> float:
    """Start (and run one job on) every World size the distributed cases can ask for."""
    started = time.perf_counter()
    for world_size in range(1, max_world_size + 1):
        stages = max(2, world_size)  # a 1-rank World runs 2 stages, 2 per rank
        spec = pst.ModelSpec((pst.InputSpec("x", "x", 2),),
                             tuple(pst.LayerSpec("linear", (k - 1,), 2) for k in range(stages)),
                             pst.OutputSpec("single", (stages - 1,)), batch=4, seed=0)
        case = pst.PipelineCase(spec, {f"l{k}": pc.SplitPoint.BEGINNING for k in range(1, stages)},
                                schedule="gpipe", stages_per_rank=stages // world_size,
                                world_size=world_size, runner="distributed")
        case.check(world=pc.World.shared(world_size))
    return time.perf_counter() - started


def throughput(opts: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    rows = []
    warm_s = 0.0
    for runner, n_cases in (("reference", opts.cases), ("distributed", opts.distributed_cases)):
        if runner == "distributed":
            warm_s = warm_worlds(4)
        for n_threads in (threads, 1):
            torch.set_num_threads(n_threads)
            rate, seconds = cases_per_second(runner, n_cases)
            label = f"{threads} (default)" if n_threads == threads else "1"
            rows.append((runner, "fp32", label, n_cases, seconds, rate))
        torch.set_num_threads(threads)
    pc.World.close_shared()
    best = {runner: max(r[5] for r in rows if r[0] == runner) for runner in TARGETS}
    lines = [
        f"Command: `python benchmarks/bench_strategies.py --cases {opts.cases} "
        f"--distributed-cases {opts.distributed_cases}`  ",
        f"Machine: {machine()}; load average {_load()} at the end (the cores are shared)",
        "",
        "A hypothesis test over `pst.pipeline_cases(runners=(runner,))` (default models, 2-4 "
        "stages, gpipe/1f1b/interleaved, 1-4 micro-batches; generate phase only, derandomized) "
        "runs `case.check()` on each case; timed end to end (drawing, building, eager fp32 and "
        "fp64 runs, the runner, the comparison). Distributed: warm Worlds of 1-4 ranks, started "
        f"before timing ({warm_s:.1f} s). Intra-op threads of the driver process as listed "
        "(the generated models are at most 16 wide; on a shared 2-core machine one thread "
        "avoids waiting on a busy second core); each rank runs cores / world size threads.",
        "",
        "| runner | dtype | driver threads | cases | seconds | cases/s | target |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
        *[f"| {runner} | {dtype} | {label} | {n} | {seconds:.1f} | {rate:.1f} | "
          f">= {TARGETS[runner]:.0f}/s |" for runner, dtype, label, n, seconds, rate in rows],
        "",
        *[f"- {runner}: **{'met' if best[runner] >= TARGETS[runner] else 'NOT met'}** "
          f"(best {best[runner]:.1f} cases/s, target {TARGETS[runner]:.0f}/s)" for runner in TARGETS],
    ]
    write_section("Strategies (generated cases per second)", "\n".join(lines))
    print("\n".join(lines))


def _load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def feature_table(path: Path) -> list[str]:
    """Markdown: cases per test, and per feature the cases of each test exercising it."""
    per_test: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        case = json.loads(line)
        totals[case["test"]] += 1
        per_test[case["test"]].update(case["features"])
        per_test[case["test"]][f"stages={case['stages']}"] += 1
        per_test[case["test"]][f"schedule={case['schedule']}"] += 1
        per_test[case["test"]][f"n_microbatches={case['n_microbatches']}"] += 1
        per_test[case["test"]][f"world_size={case['world_size']}"] += 1
        per_test[case["test"]][f"stages_per_rank={case['stages_per_rank']}"] += 1
    tests = sorted(totals)
    names = [*pst.FEATURES, *pst.CROSSINGS]
    names += sorted({name for counts in per_test.values() for name in counts} - set(names))
    lines = ["| feature | " + " | ".join(tests) + " |",
             "| --- | " + " | ".join("---:" for _ in tests) + " |",
             "| **cases** | " + " | ".join(str(totals[test]) for test in tests) + " |"]
    lines += [f"| {name} | " + " | ".join(str(per_test[test][name]) for test in tests) + " |"
              for name in names]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="reference cases per timing")
    parser.add_argument("--distributed-cases", type=int, default=100)
    parser.add_argument("--feature-counts", type=Path, help="summarise this JSON-lines file")
    parser.add_argument("--wall-s", type=float, help="wall time of the run that wrote the file")
    parser.add_argument("--command", help="the command of the run that wrote the file")
    parser.add_argument("--result", default="", help="the run's outcome, e.g. '3 passed'")
    opts = parser.parse_args()
    if opts.feature_counts is None:
        throughput(opts)
        return
    lines = feature_table(opts.feature_counts)
    if opts.wall_s is not None and opts.command:
        body = [f"Command: `{opts.command}`  ", f"Machine: {machine()}; load average {_load()}  ",
                f"Wall time: {opts.wall_s:.0f} s. Result: {opts.result or 'see below'}.", "",
                "Cases per test, and how many of them exercised each feature (the model's "
                "`features(spec)`, the split's `CROSSINGS`, the layout):", "", *lines]
        write_section("Strategies (nightly run: cases per feature)", "\n".join(body))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
