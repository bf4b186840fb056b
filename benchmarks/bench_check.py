"""Check overhead: ``assert_equivalent``'s wall time against the sum of its unavoidable parts.

    python benchmarks/bench_check.py [--device cpu|cuda] [--rounds 5] [--runner reference|distributed] [--ranks 4]

The unavoidable parts of a check are the eager micro-batched step in the check's dtype, the same
step in float64 (the ground truth) and one step of the runner; each is timed alone, on a model
built beforehand, in the same run and alternating with the check itself. The model is GPT-like
(benchmarks/_gpt.py): 8 blocks, 4 stages, 8 micro-batches; d=256 on CPU, d=1024 on a GPU.
Peak device memory (CUDA only) of the check and of the eager micro-batched step alone is recorded
too. Results go to the "Check overhead" section of benchmarks/RESULTS.md.

The distributed runner runs on ``--ranks`` ranks (default 1: every stage on one rank, nothing crosses a
process). With ``--device cuda --ranks 4`` on one GPU the ranks share it, and the stage values and
gradients pass between them on the device (CUDA IPC): the benchmark counts them, and fails if none did.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

import pipecheck as pc

# private: how many tensors the ranks passed on the device, to prove the benchmark measured that path
from pipecheck._runtime import ipc

try:
    from _gpt import GPT, GPTConfig, gpt_inputs, lm_loss
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._gpt import GPT, GPTConfig, gpt_inputs, lm_loss
    from benchmarks._results import machine, median, write_section

MICROBATCHES = 8


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    gc.collect()
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def eager_microbatched_step(model: torch.nn.Module, ids: torch.Tensor, target: torch.Tensor) -> None:
    """What any check must do once per dtype: forward and backward of each micro-batch, mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = [lm_loss(model(x), t) for x, t in zip(ids.chunk(MICROBATCHES), target.chunk(MICROBATCHES))]
    torch.autograd.grad(torch.stack(losses).mean(), params)


def _peak(fn: Callable[[], Any], device: str) -> int:
    if device != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runner", default="reference", choices=("reference", "distributed"))
    parser.add_argument("--ranks", type=int, default=1, help="the distributed runner's ranks (a divisor of 4)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    gpu = opts.device == "cuda"
    config = GPTConfig(d=opts.d or (1024 if gpu else 256), vocab=8192 if gpu else 2048, seq=256 if gpu else 64)
    batch = opts.batch or (16 if gpu else 16)
    factory = functools.partial(GPT, config)
    ids, target = gpt_inputs(config, batch, opts.device)
    if config.stages % opts.ranks:
        parser.error(f"--ranks {opts.ranks} does not divide the model's {config.stages} stages")
    world = pc.World(opts.ranks, device=opts.device) if opts.runner == "distributed" else None
    check_args: dict[str, Any] = dict(runner=opts.runner, loss_fn=lm_loss, target=target, n_microbatches=MICROBATCHES,
                                      device=opts.device, world=world)
    if world is not None:
        per_rank = config.stages // opts.ranks
        check_args.update(schedule="interleaved" if per_rank > 1 else "1f1b", stages_per_rank=per_rank)

    parts, phases, peak_eager = _measure_parts(factory, ids, target, opts.device, opts.rounds, world,
                                               config, check_args)
    peak_check = _peak(lambda: pc.assert_equivalent(factory, (ids,), **check_args), opts.device)
    on_device = _passed_on_device(world)
    if world is not None:
        world.close()
    _write(opts, config, batch, parts, phases, peak_eager, peak_check, on_device)


def _passed_on_device(world: Any) -> int | None:
    """Tensors the ranks passed each other on the device (CUDA IPC), where they share a GPU; else None."""
    if world is None or not world.properties.gpus_shared:
        return None
    shared = sum(counts["shared"] for counts in world.run(ipc.counts))
    if shared == 0:
        raise SystemExit("the ranks share a GPU but passed no tensor on it: the benchmark did not measure CUDA IPC")
    return shared


def _measure_parts(factory: Any, ids: torch.Tensor, target: torch.Tensor, device: str, rounds: int, world: Any,
                   config: GPTConfig, check_args: dict[str, Any]
                   ) -> tuple[dict[str, list[float]], list[dict[str, float]], int]:
    """The three unavoidable parts, each alone, alternating with whole checks; then the eager step's peak."""
    model = pc.ModelFactory(factory, device=device)()
    model64 = pc.ModelFactory(factory, device=device, dtype=torch.float64)()
    pipe = pc.split(model, (ids,))

    def runner_step() -> None:
        if world is None:
            pc.DetachExecutor(pipe).step((ids,), loss_fn=lm_loss, target=target, n_microbatches=MICROBATCHES)
        else:
            pc.run_pipeline(world, factory, (ids,), schedule=check_args["schedule"],
                            stages_per_rank=check_args["stages_per_rank"], n_microbatches=MICROBATCHES,
                            loss_fn=lm_loss, target=target)


    parts: dict[str, list[float]] = {"eager": [], "fp64": [], "runner": [], "check": []}
    phases: list[dict[str, float]] = []
    pc.assert_equivalent(factory, (ids,), **check_args)  # warm-up: imports, the World's first task
    runner_step()
    reports: list[pc.Report] = []
    for _ in range(rounds):
        parts["eager"].append(_timed(lambda: eager_microbatched_step(model, ids, target), device))
        parts["fp64"].append(_timed(lambda: eager_microbatched_step(model64, ids, target), device))
        parts["runner"].append(_timed(runner_step, device))
        parts["check"].append(_timed(lambda: reports.append(pc.assert_equivalent(factory, (ids,), **check_args)),
                                     device))
        phases.append(reports[-1].timings)
    return parts, phases, _peak(lambda: eager_microbatched_step(model, ids, target), device)


def _write(opts: argparse.Namespace, config: GPTConfig, batch: int, parts: dict[str, list[float]],
           phases: list[dict[str, float]], peak_eager: int, peak_check: int, on_device: int | None) -> None:
    gpu = opts.device == "cuda"
    eager, fp64, runner, check = (median(parts[k]) for k in ("eager", "fp64", "runner", "check"))
    unavoidable = eager + fp64 + runner
    ratio = check / unavoidable
    target_ratio = 1.3 if gpu else 1.2
    phase_names = sorted({k for p in phases for k in p})
    device_name = torch.cuda.get_device_name() if gpu else "CPU"
    ranks = f" --ranks {opts.ranks}" if opts.runner == "distributed" and opts.ranks > 1 else ""
    lines = [
        f"Command: `python benchmarks/bench_check.py --device {opts.device} --rounds {opts.rounds} "
        f"--runner {opts.runner}{ranks}`  ",
        f"Machine: {machine()}; device: {device_name}",
        "",
        f"GPT-like model: d={config.d}, {config.blocks} blocks (nn.MultiheadAttention), vocab {config.vocab}, "
        f"seq {config.seq}, batch {batch}, {config.stages} stages, {MICROBATCHES} micro-batches, untied; runner "
        f"{opts.runner}{f' on {opts.ranks} ranks' if ranks else ''}. Medians of {opts.rounds} rounds; each round "
        "times the three parts alone, then the check.",
        "",
        "| eager step | fp64 step | runner step | sum (unavoidable) | assert_equivalent | ratio | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {eager:.3f} s | {fp64:.3f} s | {runner:.3f} s | {unavoidable:.3f} s | {check:.3f} s | {ratio:.2f} | "
        f"<= {target_ratio}: {'met' if ratio <= target_ratio else 'NOT met'} |",
        "",
        "Where the check's time goes (`Report.timings`, medians, s): "
        + ", ".join(f"{name} {median([p.get(name, 0.0) for p in phases]):.3f}" for name in phase_names),
    ]
    if gpu:
        mem_ratio = peak_check / max(peak_eager, 1)
        lines += ["", f"Peak device memory above the model's: eager micro-batched step {peak_eager / 2**20:.0f} MiB, "
                      f"whole check {peak_check / 2**20:.0f} MiB, ratio {mem_ratio:.2f} (target <= 2.5: "
                      f"{'met' if mem_ratio <= 2.5 else 'NOT met'})."]
    if on_device is not None:
        lines += ["", f"The ranks share the GPU: {on_device} stage values and gradients passed between them on the "
                      "device (CUDA IPC), only their handles through gloo."]
    title = f"Check overhead ({opts.device}, runner {opts.runner}{f', {opts.ranks} ranks' if ranks else ''})"
    write_section(title, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
