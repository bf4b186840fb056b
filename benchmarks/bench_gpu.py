"""GPU step time: pipecheck's runtime against torch.distributed.pipelining and the eager model.

    python benchmarks/bench_gpu.py [--device cuda] [--steps 10] [--profile step.json]
    python benchmarks/bench_gpu.py --device cpu --small      # a smoke run of the same code on CPU

GPT-like model (benchmarks/_gpt.py: d=1024, 8 blocks with nn.MultiheadAttention, vocab 8192, seq
256, batch 32, 8 micro-batches, untied), all 4 stages on ONE rank (``World(1, device)``): pipecheck's
``schedule="interleaved"`` with ``stages_per_rank=4``, against torch's ScheduleInterleaved1F1B and
ScheduleLoopedBFS on stages from its own ``pipeline()``, and the eager model (full batch, and per
micro-batch). Each step is timed on the rank after two warm-ups, median of ``--steps``, with the
device synchronised around it; pipecheck's step and the transfer of its results to the host are
timed apart. ``--profile`` writes a torch.profiler trace of one pipecheck step. Results go to the
"GPU step" section of benchmarks/RESULTS.md, with the device's name.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pipecheck as pc

# private: the runtime's stage executor timed without a World (one GPU), planned as the runner plans it
from pipecheck._runners.runtime.driver import plan_schedule, step_spec
from pipecheck._runtime.executor import StageExecutor
from pipecheck._schedule.torch_classes import v_warmup_patch

try:
    from _gpt import GPT, GPTConfig, gpt_inputs, lm_loss, split_spec
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._gpt import GPT, GPTConfig, gpt_inputs, lm_loss, split_spec
    from benchmarks._results import machine, write_section

MICROBATCHES = 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, steps: int, warmups: int = 2) -> float:
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(steps):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _torch_step(ctx: Any, config: GPTConfig, ids: torch.Tensor, target: torch.Tensor, schedule: str
                ) -> Callable[[], None]:
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

    model = pc.ModelFactory(functools.partial(GPT, config), device=ctx.device)()
    spec = {name: SplitPoint.BEGINNING for name in split_spec(config)}
    pipe = pipeline(model, (ids.chunk(MICROBATCHES)[0],), split_spec=spec)
    stages = [pipe.build_stage(s, ctx.device, ctx.group) for s in range(pipe.num_stages)]
    for stage in stages:  # every stage on this one rank: torch's p2p warm-up would message itself
        v_warmup_patch(stage, ctx.rank)
    cls = {"interleaved": ScheduleInterleaved1F1B, "looped_bfs": ScheduleLoopedBFS}[schedule]
    runner = cls(stages, n_microbatches=MICROBATCHES, loss_fn=lm_loss, scale_grads=True)
    return lambda: runner.step(ids, target=target, losses=[])


def _eager_steps(ctx: Any, config: GPTConfig, ids: torch.Tensor, target: torch.Tensor
                 ) -> tuple[Callable[[], None], Callable[[], None]]:
    model = pc.ModelFactory(functools.partial(GPT, config), device=ctx.device)()
    params = list(model.parameters())

    def full() -> None:
        torch.autograd.grad(lm_loss(model(ids), target), params)

    def microbatched() -> None:
        losses = [lm_loss(model(x), t) for x, t in zip(ids.chunk(MICROBATCHES), target.chunk(MICROBATCHES))]
        torch.autograd.grad(torch.stack(losses).mean(), params)

    return full, microbatched


def rank_timings(ctx: Any, spec: Any, config: GPTConfig, steps: int, profile: str | None) -> dict[str, float]:
    """Every engine's step on this rank (it holds all stages), the device synchronised around each."""
    device = ctx.device
    ids, target = gpt_inputs(config, 32 if device.type == "cuda" else 8, str(device))
    executor = StageExecutor(ctx, spec)
    timings = {
        "pipecheck_step": _median_time(executor.step, device, steps),
        "pipecheck_transfer": _median_time(executor.collect, device, steps, warmups=0),
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            executor.step()
            _sync(device)
        prof.export_chrome_trace(profile)
        timings["profile_top"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)  # type: ignore[assignment]
    del executor
    for schedule in ("interleaved", "looped_bfs"):
        timings[f"torch_{schedule}"] = _median_time(_torch_step(ctx, config, ids, target, schedule), device, steps)
    full, microbatched = _eager_steps(ctx, config, ids, target)
    timings["eager_full"] = _median_time(full, device, steps)
    timings["eager_microbatched"] = _median_time(microbatched, device, steps)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke run, not a measurement")
    parser.add_argument("--profile", metavar="TRACE.json", help="write a torch.profiler trace of one step")
    opts = parser.parse_args()
    config = GPTConfig(d=64, vocab=256, seq=16, heads=4) if opts.small else GPTConfig(d=1024, vocab=8192, seq=256)
    batch = 32 if opts.device == "cuda" else 8
    ids, target = gpt_inputs(config, batch)
    job = pc.Job(model=pc.ModelFactory(functools.partial(GPT, config)), args=(ids,), loss_fn=lm_loss, target=target,
                 n_microbatches=MICROBATCHES, schedule="interleaved", stages_per_rank=config.stages,
                 device=opts.device)
    pipe = job.split()
    spec = step_spec(job, plan_schedule(job, pipe), pipe)
    with pc.World(1, device=opts.device, timeout=600) as world:
        timings = world.run(rank_timings, spec, config, opts.steps, opts.profile)[0]
    device_name = torch.cuda.get_device_name() if opts.device == "cuda" else "CPU"
    ms = {key: value * 1e3 for key, value in timings.items() if isinstance(value, float)}
    step = ms["pipecheck_step"]
    vs_torch = step / ms["torch_interleaved"]
    vs_eager = step / ms["eager_microbatched"]
    lines = [
        f"Command: `python benchmarks/bench_gpu.py --device {opts.device} --steps {opts.steps}"
        f"{' --small' if opts.small else ''}`  ",
        f"Machine: {machine()}; device: {device_name}",
        "",
        f"GPT-like model d={config.d}, {config.blocks} blocks, vocab {config.vocab}, seq {config.seq}, batch {batch}, "
        f"{MICROBATCHES} micro-batches, 4 stages on one rank; median of {opts.steps} steps after 2 warm-ups:",
        "",
        "| step | ms |",
        "| --- | --- |",
        f"| eager, full batch | {ms['eager_full']:.1f} |",
        f"| eager, {MICROBATCHES} micro-batches | {ms['eager_microbatched']:.1f} |",
        f"| torch ScheduleLoopedBFS | {ms['torch_looped_bfs']:.1f} |",
        f"| torch ScheduleInterleaved1F1B | {ms['torch_interleaved']:.1f} |",
        f"| **pipecheck interleaved (step)** | **{step:.1f}** |",
        f"| pipecheck: results to the host, after the step | {ms['pipecheck_transfer']:.1f} |",
        "",
        f"pipecheck / torch Interleaved1F1B: {vs_torch:.2f} (target <= 0.8: {'met' if vs_torch <= 0.8 else 'NOT met'}); "
        f"pipecheck / eager micro-batched: {vs_eager:.2f} (target <= 1.3: {'met' if vs_eager <= 1.3 else 'NOT met'}).",
    ]
    if "profile_top" in timings:
        lines += ["", "torch.profiler, one pipecheck step, top operators by self CPU time:", "", "```",
                  str(timings["profile_top"]).strip(), "```"]
    if not opts.small:
        write_section(f"GPU step ({device_name})", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
