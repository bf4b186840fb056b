"""What a training check costs: k optimizer steps against one, and data parallel against a plain pipeline.

    python benchmarks/bench_training.py [--rounds 5]

(a) ``assert_equivalent(..., steps=3, optimizer=sgd)`` against the same check with ``steps=1``, on the
reference runner and on pipecheck's runtime (a warm World of 2); target <= 3.5x.
(b) a ``data_parallel=2`` check of a 2-stage pipeline on a warm World of 4 against the same check
with ``data_parallel=1`` on a warm World of 2 (the same global batch); target <= 2x.

Each pair is timed alternating in one run, rounds medians. The model is the GPT of benchmarks/_gpt.py
(tied embedding, 2 stages). Results go to the "Training checks" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

import pipecheck as pc

try:
    from _gpt import GPT, GPTConfig, gpt_inputs, lm_loss
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._gpt import GPT, GPTConfig, gpt_inputs, lm_loss
    from benchmarks._results import machine, median, write_section

CONFIG = GPTConfig(d=128, blocks=4, heads=4, vocab=512, seq=32, stages=2, tied=True)
BATCH, MICROBATCHES = 16, 4


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _check(**settings: Any) -> float:
    ids, target = gpt_inputs(CONFIG, BATCH)
    started = time.perf_counter()
    pc.assert_equivalent(make_model, (ids,), loss_fn=lm_loss, target=target, n_microbatches=MICROBATCHES,
                         optimizer=sgd, **settings)
    return time.perf_counter() - started


def _pair(rounds: int, first: dict[str, Any], second: dict[str, Any]) -> tuple[float, float, list[float]]:
    """Both checks, alternating, ``rounds`` times after one warm-up each: medians and per-round ratios."""
    _check(**first), _check(**second)
    a, b = [], []
    for _ in range(rounds):
        a.append(_check(**first))
        b.append(_check(**second))
    return median(a), median(b), [x / y for x, y in zip(a, b)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    two, four = pc.World.shared(2), pc.World.shared(4)
    rows = []
    for runner, world in (("reference", None), ("distributed", two)):
        extra = {"runner": runner, **({"world": world} if world is not None else {})}
        three, one, ratios = _pair(rounds, {**extra, "steps": 3}, {**extra, "steps": 1})
        rows.append(f"| (a) {runner}: steps=3 vs steps=1 | {three * 1e3:.0f} ms | {one * 1e3:.0f} ms | "
                    f"{three / one:.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) | <= 3.5x: "
                    f"{'met' if three / one <= 3.5 else 'NOT met'} |")
    dp, pp, ratios = _pair(rounds, {"runner": "distributed", "world": four, "data_parallel": 2},
                           {"runner": "distributed", "world": two})
    rows.append(f"| (b) distributed: dp=2 x pp=2 (World of 4) vs pp=2 (World of 2) | {dp * 1e3:.0f} ms | "
                f"{pp * 1e3:.0f} ms | {dp / pp:.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) | <= 2x: "
                f"{'met' if dp / pp <= 2 else 'NOT met'} |")
    pc.World.close_shared()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    BREAK = "  "  # a markdown line break, written so that no line of this file ends in spaces
    write_section("Training checks", f"""
Command: `python benchmarks/bench_training.py --rounds {rounds}`{BREAK}
Machine: {machine()}; load average {load} at the end (the cores are shared).{BREAK}
Model: benchmarks/_gpt.py GPT (d={CONFIG.d}, {CONFIG.blocks} blocks, vocab {CONFIG.vocab}, seq {CONFIG.seq}, tied
embedding), {CONFIG.stages} stages, batch {BATCH}, {MICROBATCHES} micro-batches, SGD; whole `assert_equivalent` wall
time (eager fp32 and fp64 training included), warm Worlds, medians of {rounds} alternating rounds (per-round ratios).

| check | first | second | ratio | target |
| --- | --- | --- | --- | --- |
{chr(10).join(rows)}
""")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
