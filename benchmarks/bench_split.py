"""Time ``pc.split`` against ``torch.distributed.pipelining.pipeline``; write benchmarks/RESULTS.md.

    python benchmarks/bench_split.py                          # L in 64 128 256 512, 5 repeats
    python benchmarks/bench_split.py --layers 64 512 --repeats 3

The model is L blocks of Linear(32, 32) + Tanh in a ModuleList loop, cut into
4 stages at ``layers.{L/4}``, ``layers.{L/2}``, ``layers.{3L/4}`` (BEGINNING)
for both splitters. Every timed call gets a freshly built model (built outside
the timer): torch's ``pipeline`` rewrites the modules' ``forward`` in place, and
``pc.split`` deep-copies its model, which is part of what it costs.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint as TorchSplitPoint
from torch.distributed.pipelining import pipeline

import pipecheck as pc

try:
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, write_section

WIDTH = 32
STAGES = 4
HEADING = "Split time (pc.split vs torch.distributed.pipelining.pipeline)"
TARGET_SPEEDUP = 10.0
LINEAR_SLOPE = 1.1  # log-log slope at most this counts as linear growth
CLOCKS = {"cpu": ("process CPU", time.process_time), "wall": ("wall-clock", time.perf_counter)}


class Stack(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_model(n_layers: int) -> Stack:
    torch.manual_seed(0)
    return Stack(n_layers)


def cut_fqns(n_layers: int) -> list[str]:
    return [f"layers.{n_layers * k // STAGES}" for k in range(1, STAGES)]


def example_input() -> tuple[torch.Tensor]:
    return (torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1)),)


def pc_split(tracer: str) -> Callable[[nn.Module], pc.Pipe]:
    def run(model: nn.Module) -> pc.Pipe:
        spec = {fqn: pc.SplitPoint.BEGINNING for fqn in cut_fqns(len(model.layers))}
        return pc.split(model, example_input(), split_spec=spec, tracer=tracer)
    return run


def torch_pipeline(model: nn.Module) -> nn.Module:
    spec = {fqn: TorchSplitPoint.BEGINNING for fqn in cut_fqns(len(model.layers))}
    return pipeline(model, example_input(), split_spec=spec)


SPLITTERS = {"pc.split fx": pc_split("fx"), "pc.split export": pc_split("export"),
             "torch pipeline": torch_pipeline}


def check_splits(n_layers: int) -> None:
    """Every splitter gives 4 stages that compute the eager output, so no broken split is timed."""
    x = example_input()
    expected = make_model(n_layers)(*x)
    for name in ("pc.split fx", "pc.split export"):
        pipe = SPLITTERS[name](make_model(n_layers))
        got = pc.DetachExecutor(pipe).step(x).outputs
        if pipe.num_stages != STAGES or not torch.allclose(got, expected, atol=1e-6):
            sys.exit(f"{name} is broken at L={n_layers}: {pipe.num_stages} stages, output differs")
    torch_pipe = torch_pipeline(make_model(n_layers))
    got = torch_pipe(*x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    if torch_pipe.num_stages != STAGES or not torch.allclose(got, expected, atol=1e-6):
        sys.exit(f"torch pipeline is broken at L={n_layers}: {torch_pipe.num_stages} stages")


def time_once(split: Callable[[nn.Module], object], n_layers: int, clock: Callable[[], float]) -> float:
    model = make_model(n_layers)
    gc.collect()  # every call starts from the same collector state; gc stays on while timed
    start = clock()
    split(model)
    return clock() - start


def log_log_slope(layers: list[int], seconds: list[float]) -> float:
    if len(layers) < 2:
        return math.nan
    fit = statistics.linear_regression([math.log(n) for n in layers], [math.log(t) for t in seconds])
    return fit.slope


def render(layers: list[int], median: dict[str, list[float]], cold: dict[str, float],
           opts: argparse.Namespace, command: str) -> str:
    fx, torch_s = median["pc.split fx"], median["torch pipeline"]
    speedups = [t / f for t, f in zip(torch_s, fx, strict=True)]
    slope = log_log_slope(layers, fx)
    torch_slope = log_log_slope(layers, torch_s)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average {load} at the end (the machine is shared).  ",
        f"Model: L x (Linear({WIDTH}, {WIDTH}) + Tanh), {STAGES} stages cut at layers.L/4, L/2, 3L/4 "
        f"(SplitPoint.BEGINNING). Times: {CLOCKS[opts.clock][0]} seconds, median of {opts.repeats} "
        "calls after one warm-up call per splitter and size; each call gets a fresh model and "
        "starts after gc.collect() (gc stays on while timed).", "",
        "| layers | pc.split fx | pc.split export | torch pipeline | speed-up (torch/fx) "
        "| fx ms/layer |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, n in enumerate(layers):
        lines.append(f"| {n} | {fx[i]:.3f} | {median['pc.split export'][i]:.3f} | "
                     f"{torch_s[i]:.3f} | {speedups[i]:.1f}x | {1000 * fx[i] / n:.2f} |")
    lines.append("")
    lines.append(f"Cold first call at L={layers[0]} (imports and caches; run in table order): "
                 + ", ".join(f"{name} {t:.3f} s" for name, t in cold.items()) + ".")
    lines.append("")
    met = min(speedups) >= TARGET_SPEEDUP
    lines.append(f"- 10x target (torch pipeline / pc.split fx >= {TARGET_SPEEDUP:.0f} at every size): "
                 f"**{'met' if met else 'NOT met'}** (lowest {min(speedups):.1f}x, "
                 f"highest {max(speedups):.1f}x).")
    linear = slope <= LINEAR_SLOPE
    lines.append(f"- Linear growth (log-log slope of pc.split fx time vs layers <= {LINEAR_SLOPE}): "
                 f"**{'met' if linear else 'NOT met'}** (slope {slope:.2f}; torch pipeline "
                 f"{torch_slope:.2f}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this process's CPU time (steady on a shared machine); wall: elapsed")
    opts = parser.parse_args()
    layers = sorted(opts.layers)
    clock = CLOCKS[opts.clock][1]
    bad = [n for n in layers if n < STAGES]
    if bad or opts.repeats < 1:
        parser.error(f"need layers >= {STAGES} and repeats >= 1 (layers: {bad}, "
                     f"repeats: {opts.repeats})")
    warnings.filterwarnings("ignore")  # torch.export's deprecation chatter
    median: dict[str, list[float]] = {name: [] for name in SPLITTERS}
    cold: dict[str, float] = {}
    for n in layers:
        for name, split in SPLITTERS.items():
            first = time_once(split, n, clock)  # warm-up
            cold.setdefault(name, first)
            median[name].append(statistics.median(time_once(split, n, clock) for _ in range(opts.repeats)))
            print(f"L={n:4d} {name:16s} {median[name][-1]:8.3f} s", flush=True)
        check_splits(n)  # after timing, so the cold first calls stay cold; before any result is written
    command = "python benchmarks/bench_split.py " + " ".join(sys.argv[1:])
    section = render(layers, median, cold, opts, command.strip())
    write_section(HEADING, section)
    print(f"\n## {HEADING}\n\n{section}")


if __name__ == "__main__":
    main()
