"""Zero-bubble benchmark: the bubble measured in pipecheck's timeline, ZB-H1 against 1F1B and ZB-V
against interleaved 1F1B, on the same model and the same World.

    python benchmarks/bench_zero_bubble.py [--rounds 5] [--microbatches 4,8]

One MLP of four blocks (Linear-GELU-Linear, width ``--width``), batch ``--batch``, on 2 gloo ranks
with one intra-op thread each: cut in 2 stages for "1f1b" and "zb" (one stage per rank), in 4 for
"interleaved" and "zbv" (two per rank; loop and V placement). Every round runs every schedule once,
in turn, after one warm-up step of each; the table gives medians over the rounds of the bubble
(1 - compute time / (ranks x span of the step's compute), from the step's events) and of that span,
next to the unit-time model's bubble (F = I = W = 1, B = 2: the zero-bubble paper's cost model).
Results go to the "Zero-bubble schedules" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecheck as pc

# private: the timeline's bubble measure is what this benchmark reports
from pipecheck._runtime.timeline import Event, measured_bubble_fraction
from pipecheck.schedules import make_schedule, simulated_bubble_fraction

try:
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, median, write_section

RANKS = 2
# (schedule, stages): the pairs compared, each zero-bubble schedule after its F/B counterpart
LAYOUTS = [("1f1b", 2), ("zb", 2), ("interleaved", 4), ("zbv", 4)]


class Blocks(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Factory:
    """A picklable factory of the benchmark model (what travels to the ranks)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self) -> nn.Module:
        return Blocks(self.width)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _cut(stages: int) -> dict[str, str]:
    every = 4 // stages
    return {f"layers.{i}": "BEGINNING" for i in range(every, 4, every)}


def _span_ms(events: list[Event]) -> float:
    compute = [e for e in events if e.category in ("forward", "backward")]
    return (max(e.end_ns for e in compute) - min(e.start_ns for e in compute)) / 1e6


def _work_ms(events: list[Event]) -> dict[str, float]:
    """Compute time of the step by action kind (F, B, I, W), summed over ranks."""
    work: dict[str, float] = {}
    for e in events:
        if e.category in ("forward", "backward"):
            kind = next(c for c in e.name if c in "FBIW")
            work[kind] = work.get(kind, 0.0) + (e.end_ns - e.start_ns) / 1e6
    return work


def bench(width: int, batch: int, microbatches: list[int], rounds: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    factory = Factory(width)
    runs = [(schedule, stages, m) for m in microbatches for schedule, stages in LAYOUTS]
    measured: dict[tuple[str, int, int], list[tuple[float, float]]] = {run: [] for run in runs}
    work: dict[tuple[str, int, int], list[dict[str, float]]] = {run: [] for run in runs}
    with pc.World(RANKS, timeout=600, threads_per_rank=1) as world:

        def step(schedule: str, stages: int, m: int) -> list[Event]:
            result = pc.run_pipeline(world, factory, (x,), split_spec=_cut(stages), schedule=schedule,
                                     stages_per_rank=stages // RANKS, n_microbatches=m, loss_fn=_loss,
                                     target=target)
            return result.events

        for run in runs:
            step(*run)  # warm-up
        for _ in range(rounds):
            for run in runs:
                events = step(*run)
                measured[run].append((measured_bubble_fraction(events), _span_ms(events)))
                work[run].append(_work_ms(events))
    rows = []
    for schedule, stages, m in runs:
        bubbles = [b for b, _ in measured[(schedule, stages, m)]]
        spans = [s for _, s in measured[(schedule, stages, m)]]
        model = simulated_bubble_fraction(make_schedule(schedule, stages, m, stages // RANKS), durations={"B": 2})
        kinds = {kind: median([w.get(kind, 0.0) for w in work[(schedule, stages, m)]]) for kind in "FBIW"}
        rows.append({"schedule": schedule, "stages": stages, "m": m, "bubble": median(bubbles),
                     "bubbles": bubbles, "span_ms": median(spans), "model": model, "work": kinds})
    return rows


def _comparisons(rows: list[dict[str, Any]]) -> list[str]:
    """One line per zero-bubble schedule against its F/B counterpart at each micro-batch count."""
    by = {(r["schedule"], r["m"]): r for r in rows}
    lines = []
    for zero, base in (("zb", "1f1b"), ("zbv", "interleaved")):
        for m in sorted({r["m"] for r in rows}):
            z, b = by[(zero, m)], by[(base, m)]
            lines.append(f"- {zero} against {base}, m={m}: measured bubble {z['bubble']:.3f} vs {b['bubble']:.3f} "
                         f"({z['bubble'] - b['bubble']:+.3f}; the model: {z['model'] - b['model']:+.3f}), span "
                         f"{z['span_ms']:.0f} vs {b['span_ms']:.0f} ms")
    spread = max(max(r["bubbles"]) - min(r["bubbles"]) for r in rows)
    gaps = [abs(by[(zero, m)]["bubble"] - by[(base, m)]["bubble"]) for zero, base in (("zb", "1f1b"),
            ("zbv", "interleaved")) for m in {r["m"] for r in rows}]
    verdict = ("more than any difference above, so these runs do not resolve them" if max(gaps) < spread
               else "less than the largest difference above")
    lines.append(f"- One schedule's bubble varies by up to {spread:.2f} between rounds on this machine, {verdict}.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    opts = parser.parse_args()
    started = time.perf_counter()
    rows = bench(opts.width, opts.batch, [int(m) for m in opts.microbatches.split(",")], opts.rounds)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    lines = [
        f"Command: `python benchmarks/bench_zero_bubble.py --rounds {opts.rounds} --microbatches "
        f"{opts.microbatches} --width {opts.width} --batch {opts.batch}`  ",
        f"Machine: {machine()}; load average {load} at the end (the machine is shared); "
        f"{time.perf_counter() - started:.0f} s in all",
        "",
        f"Model: 4 blocks of Linear({opts.width}, {opts.width})-GELU-Linear, batch {opts.batch}, MSE loss; "
        f"{RANKS} gloo ranks, 1 intra-op thread each. 2 stages (one per rank) for 1f1b and zb; 4 stages (two "
        "per rank) for interleaved (loop placement) and zbv (V placement). Measured bubble: 1 - compute time / "
        "(ranks x span from the first to the last compute event of the step), median over the rounds "
        "(each round runs every schedule once, in turn); span: median of that span. Model bubble: the "
        "schedule's unit-time simulation with F = I = W = 1 and B = 2.",
        "",
        "| schedule | stages | m | measured bubble | per round | span (ms) | model bubble |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
        *[f"| {r['schedule']} | {r['stages']} | {r['m']} | {r['bubble']:.3f} | "
          f"{', '.join(f'{b:.2f}' for b in r['bubbles'])} | {r['span_ms']:.0f} | {r['model']:.3f} |" for r in rows],
        "",
        *_comparisons(rows),
        "",
        "Compute of one step by action kind, summed over both ranks (ms, median over the rounds). pipecheck's W "
        "walks the stage's graph again from its outputs (plain autograd: bitwise equal to a full backward, and "
        "right where torch's split fails), so I + W costs more than B: a W recomputes the stage's inner "
        "input gradients. Stage 0's I is empty (the model input needs no gradient) and its W is a full backward.",
        "",
        "| schedule | stages | m | F | B | I | W | backward (B or I + W) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[f"| {r['schedule']} | {r['stages']} | {r['m']} | "
          + " | ".join(f"{r['work'][k]:.0f}" if r['work'][k] else "-" for k in "FBIW")
          + f" | {r['work']['B'] + r['work']['I'] + r['work']['W']:.0f} |" for r in rows],
    ]
    write_section("Zero-bubble schedules (measured bubble against 1F1B)", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
