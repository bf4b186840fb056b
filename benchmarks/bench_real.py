"""Warm distributed checks of the HF zoo models against their unavoidable work.

    python benchmarks/bench_real.py [--rounds 3] [--models hf_llama,hf_gpt2,hf_bert,hf_t5]

For each model (2 stages, 4 micro-batches, the zoo's cut, tracer "auto"), on a warm World of 2 ranks,
each round times, alternating:

- the unavoidable parts, each alone: one split (``pc.split``), the reference step on it
  (``DetachExecutor``), and the eager micro-batched step in float32 and in float64;
- ``assert_equivalent(runner="distributed")`` as the first check of its model (the driver traces it,
  the ranks cut their model along the driver's graph, no rank traces);
- the same check again: the trace of the first is reused (``pipecheck._split.reuse``);
- the check as it ran before: no reuse, the recipe withheld, every rank traces the model again.

Results go to the "Real models: warm distributed checks" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.utils._pytree as pytree

import pipecheck as pc
from pipecheck import fixtures

# private: the benchmark withholds the recipe and forgets reused traces to time the check as it was before;
# it cuts and casts micro-batches as pipecheck does
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.recipe import SplitRecipe
from pipecheck._split.reuse import forget_splits

try:
    from _results import machine, median, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, median, write_section

MICROBATCHES = 4
MODELS = ("hf_llama", "hf_gpt2", "hf_bert", "hf_t5")


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def eager_microbatched_step(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                            dtype: torch.dtype) -> None:
    """Forward and backward of each micro-batch in ``dtype``, the loss a projection of every output element."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for mb_args, mb_kwargs in split_microbatches(cast_inputs((args, kwargs), dtype, None), MICROBATCHES):
        out = model(*mb_args, **mb_kwargs)
        losses.append(sum((leaf * 0.01).sum() for leaf in pytree.tree_leaves(out)
                          if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()))
    torch.autograd.grad(torch.stack(losses).mean(), params, allow_unused=True)


def measure(name: str, world: pc.World, rounds: int) -> dict[str, Any]:
    entry = fixtures.get(name)
    args, kwargs = entry.inputs()
    cut = entry.cut(entry.cut_styles[0])
    factory = pc.ModelFactory(entry.factory(entry.cut_styles[0]), seed=0)
    model, model64 = factory(), pc.ModelFactory(entry.factory(entry.cut_styles[0]), seed=0, dtype=torch.float64)()
    check = dict(runner="distributed", world=world, n_microbatches=MICROBATCHES, loss_fn=entry.loss_fn,
                 target=entry.target(), **cut)
    pipe = pc.split(factory, args, kwargs, **cut)

    def reference_step() -> None:
        pc.DetachExecutor(pipe).step(args, kwargs, n_microbatches=MICROBATCHES)

    def checked(recipe: bool = True, reuse: bool = False) -> Callable[[], None]:
        def run() -> None:
            if not reuse:
                forget_splits()
            if recipe:
                reports.append(pc.assert_equivalent(factory, args, kwargs, **check))
            else:
                with mock.patch.object(SplitRecipe, "dumps", lambda self: None):
                    pc.assert_equivalent(factory, args, kwargs, **check)
        return run

    reports: list[pc.Report] = []
    checked()()  # warm-up: the World's first task of this model, imports
    checked(recipe=False)()
    parts: dict[str, list[float]] = {k: [] for k in ("split", "reference", "eager", "fp64", "check", "again",
                                                     "before")}
    firsts: list[pc.Report] = []
    for _ in range(rounds):
        parts["split"].append(_timed(lambda: pc.split(factory, args, kwargs, **cut)))
        parts["reference"].append(_timed(reference_step))
        parts["eager"].append(_timed(lambda: eager_microbatched_step(model, args, kwargs, torch.float32)))
        parts["fp64"].append(_timed(lambda: eager_microbatched_step(model64, args, kwargs, torch.float64)))
        parts["check"].append(_timed(checked()))
        firsts.append(reports[-1])
        parts["again"].append(_timed(checked(reuse=True)))
        parts["before"].append(_timed(checked(recipe=False)))
    result: dict[str, Any] = {k: median(v) for k, v in parts.items()}
    result["unavoidable"] = sum(result[k] for k in ("split", "reference", "eager", "fp64"))
    result["timings"] = {k: median([r.timings.get(k, 0.0) for r in firsts]) for k in sorted(firsts[-1].timings)}
    result["tracer"] = pipe.tracer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    opts = parser.parse_args()
    rows, phases = [], []
    with pc.World(2) as world:
        for name in opts.models.split(","):
            r = measure(name, world, opts.rounds)
            ratio = r["check"] / r["unavoidable"]
            rows.append(f"| {name} ({r['tracer']}) | {r['split']:.2f} | {r['reference']:.2f} | {r['eager']:.2f} | "
                        f"{r['fp64']:.2f} | {r['unavoidable']:.2f} | {r['check']:.2f} | {ratio:.2f} "
                        f"({'met' if ratio <= 1.5 else 'NOT met'}) | {r['again']:.2f} | {r['before']:.2f} |")
            phases.append(f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["timings"].items()))
            print(rows[-1], flush=True)
    lines = [
        f"Command: `python benchmarks/bench_real.py --rounds {opts.rounds} --models {opts.models}`  ",
        f"Machine: {machine()}; device: CPU",
        "",
        f"Warm World of 2 ranks; 2 stages (the zoo's cut), {MICROBATCHES} micro-batches, tracer 'auto'. Medians of "
        f"{opts.rounds} rounds; each round times the parts alone, then three checks: the first of its model "
        "(the driver traces, the ranks cut along its graph), the same check again (the trace reused), and the "
        "check with the recipe withheld and no reuse (every rank traces again, as before trace-once). Seconds; target: "
        "the first check <= 1.5x unavoidable.",
        "",
        "| model | split | reference step | eager fp32 | eager fp64 | unavoidable | check | ratio | "
        "check, model seen before | check, recipe withheld (every rank traces) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Where the check's time goes (`Report.timings`, medians, s):",
        "",
        *phases,
    ]
    write_section("Real models: warm distributed checks", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
