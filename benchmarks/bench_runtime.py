"""Runtime benchmarks: warm check latency, 1F1B step time against torch, measured bubbles.

    python benchmarks/bench_runtime.py [--checks 10] [--steps 20]

(a) ``assert_equivalent`` of a 4-stage zoo model on 4 CPU ranks, 4 micro-batches, on a live
    World, against spawning a fresh process group per check (torch.multiprocessing.spawn);
(b) step time of pipecheck's 1F1B against torch.distributed.pipelining's Schedule1F1B on the
    same 4-stage MLP, 8 micro-batches, 4 gloo ranks (timed on the ranks, between barriers);
(c) the bubble fraction measured from the timeline against (p-1)/(m+p-1).
Results go to the "Runtime" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pipecheck.fixtures import get

import pipecheck as pc

# private: the runtime's step timed rank by rank, planned and merged as the runner does
from pipecheck._runners.runtime.driver import merge_rank_results, plan_schedule, step_spec
from pipecheck._runtime.executor import StageExecutor, StepSpec, rank_step
from pipecheck._runtime.timeline import measured_bubble_fraction
from pipecheck._world.world import RankContext

try:
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, median, write_section

WIDTH, BATCH, STAGES, MICROBATCHES = 512, 64, 4, 8


class BenchMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(STAGES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def bench_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


SPEC = {f"layers.{i}": "BEGINNING" for i in range(1, STAGES)}


# --- (a) warm check vs spawn per check ---------------------------------------------------------

def _spawned_rank(rank: int, plan: Any, folder: str, world_size: int) -> None:
    store = dist.FileStore(f"{folder}/store", world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ctx = RankContext(rank=rank, world_size=world_size, device=torch.device("cpu"), backend="gloo")
    result = rank_step(ctx, plan)
    Path(f"{folder}/{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def spawn_runner(job: pc.Job) -> pc.StepResult:
    """The same runtime, but a fresh process group per check, as torch.multiprocessing.spawn tests do."""
    pipe = job.structure()
    plan = step_spec(job, plan_schedule(job, pipe), pipe)
    world_size = plan.schedule.n_ranks
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(_spawned_rank, args=(plan, folder, world_size), nprocs=world_size, join=True)
        results = [pickle.loads(Path(f"{folder}/{r}.pkl").read_bytes()) for r in range(world_size)]
    return merge_rank_results(pipe, results, job.n_microbatches)


def bench_checks(n_checks: int) -> dict[str, float]:
    entry = get("mlp")
    args, kwargs = entry.inputs()

    def check(runner: Any, world: Any = None) -> float:
        started = time.perf_counter()
        pc.assert_equivalent(entry.factory(), args, kwargs, runner=runner, n_microbatches=4, world=world)
        return time.perf_counter() - started

    with pc.World(4) as world:
        check("distributed", world)  # first job on the world: imports on the ranks
        warm = [check("distributed", world) for _ in range(n_checks)]
    spawn = [check(spawn_runner) for _ in range(max(3, n_checks // 3))]
    return {"warm": median(warm), "spawn": median(spawn), "n_warm": len(warm), "n_spawn": len(spawn)}


# --- (b) step time against torch's Schedule1F1B ------------------------------------------------

def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def step_walls(step: Any, n_steps: int) -> list[float]:
    """The wall time of each of ``n_steps`` steps, every rank starting and ending it together (no warm-up)."""
    times = []
    for _ in range(n_steps):
        dist.barrier()
        started = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return times


def _timed(step: Any, n_steps: int) -> float:
    step()  # warm-up
    return median(step_walls(step, n_steps))


def pipecheck_steps(ctx: Any, plan: StepSpec, n_steps: int, timed: Callable[[Any, int], Any] = _timed) -> Any:
    """``timed``: how the steps are timed (bench_step_cpu.py times their CPU too)."""
    runner = StageExecutor(ctx, plan)
    torch.set_num_threads(1)
    return timed(runner.run, n_steps)


def torch_steps(ctx: Any, n_steps: int, timed: Callable[[Any, int], Any] = _timed) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = BenchMLP()
    x, target = bench_inputs()
    spec = {name: SplitPoint.BEGINNING for name in SPEC}
    pipe = pipeline(model, mb_args=(x.chunk(MICROBATCHES)[0],), split_spec=spec)
    stage = pipe.build_stage(ctx.rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    last = ctx.rank == ctx.world_size - 1

    def step() -> None:
        if ctx.rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()

    return timed(step, n_steps)


def bench_step(n_steps: int, rounds: int) -> dict[str, Any]:
    """Alternate the two engines for several rounds on one World: the ratio of the medians, and
    each round's ratio (four ranks on this machine's cores make single rounds noisy)."""
    x, target = bench_inputs()
    job = pc.Job(model=pc.ModelFactory(BenchMLP), args=(x,), split_spec=SPEC, loss_fn=_loss, target=target,
                 n_microbatches=MICROBATCHES, schedule="1f1b")
    pipe = job.split()
    plan = step_spec(job, plan_schedule(job, pipe), pipe)
    ours, theirs = [], []
    with pc.World(STAGES, timeout=600) as world:
        for _ in range(rounds):
            ours.append(max(world.run(pipecheck_steps, plan, n_steps)))
            theirs.append(max(world.run(torch_steps, n_steps)))
    return {"pipecheck": median(ours), "torch": median(theirs),
            "ratios": [a / b for a, b in zip(ours, theirs)]}


# --- (c) bubbles ---------------------------------------------------------------------------

def bench_bubbles() -> list[tuple[str, int, int, float, float]]:
    x, target = bench_inputs()
    rows = []
    with pc.World(STAGES, timeout=600) as world:
        for schedule in ("gpipe", "1f1b"):
            for m in (4, 8):
                res = pc.run_pipeline(world, BenchMLP, (x,), split_spec=SPEC, schedule=schedule, n_microbatches=m,
                                      loss_fn=_loss, target=target)
                res = pc.run_pipeline(world, BenchMLP, (x,), split_spec=SPEC, schedule=schedule, n_microbatches=m,
                                      loss_fn=_loss, target=target)  # the second, warm step is measured
                theory = (STAGES - 1) / (m + STAGES - 1)
                rows.append((schedule, STAGES, m, measured_bubble_fraction(res.events), theory))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    checks = bench_checks(opts.checks)
    step = bench_step(opts.steps, opts.rounds)
    bubbles = bench_bubbles()
    ratio = step["pipecheck"] / step["torch"]
    speedup = checks["spawn"] / checks["warm"]
    lines = [
        f"Command: `python benchmarks/bench_runtime.py --checks {opts.checks} --steps {opts.steps} "
        f"--rounds {opts.rounds}`  ",
        f"Machine: {machine()}",
        "",
        "(a) Warm check latency: `assert_equivalent` of zoo `mlp` (4 stages, 4 ranks, 4 micro-batches, "
        "fp64 ground truth included) on a live World vs a fresh process group per check "
        "(torch.multiprocessing.spawn), medians:",
        "",
        "| live World | spawn per check | speed-up | target |",
        "| --- | --- | --- | --- |",
        f"| {checks['warm'] * 1e3:.0f} ms (n={checks['n_warm']}) | {checks['spawn'] * 1e3:.0f} ms "
        f"(n={checks['n_spawn']}) | {speedup:.1f}x | >= 20x: {'met' if speedup >= 20 else 'NOT met'} |",
        "",
        f"(b) Step time, 4-stage MLP (width {WIDTH}, batch {BATCH}), {MICROBATCHES} micro-batches, 4 gloo ranks, "
        f"median of {opts.steps} steps between barriers on the slowest rank, median over {opts.rounds} "
        f"alternating rounds (per-round ratios: {', '.join(f'{r:.2f}' for r in step['ratios'])}):",
        "",
        "| pipecheck 1F1B | torch Schedule1F1B | ratio | target |",
        "| --- | --- | --- | --- |",
        f"| {step['pipecheck'] * 1e3:.1f} ms | {step['torch'] * 1e3:.1f} ms | {ratio:.2f} | "
        f"<= 0.7: {'met' if ratio <= 0.7 else 'NOT met'} |",
        "",
        "(c) Bubble fraction from the timeline (1 - compute time / (ranks x step span)) against (p-1)/(m+p-1). "
        "Four ranks share the machine's cores, so measured bubbles include time a rank waits for a core:",
        "",
        "| schedule | p | m | measured | theoretical |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {s} | {p} | {m} | {got:.2f} | {want:.2f} |" for s, p, m, got, want in bubbles],
    ]
    write_section("Runtime (warm checks, step time, bubbles)", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
