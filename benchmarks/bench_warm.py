"""Warm distributed checks of every HF family of the real-model suite: each reuses its split, or is flagged.

    python benchmarks/bench_warm.py [--repeats 3] [--families hf|llama,gptj,...]

For each family of benchmarks/real_models.py (tiny config, its defaults, in eval mode so that dropout
does not decide the outcome; 2 stages, 2 micro-batches), on one warm World of 2 ranks: the first check
of the model (the driver traces it, the ranks cut their models along the driver's graph), then
``--repeats`` identical checks, timed. A family reuses its split when none of the repeats traced the
model in the driver, the driver's recipe pickles (what the ranks are sent), and a rank's split cut along
it needs no trace (``split_on`` with tracing forbidden, as a rank runs it). A check that is refused
(a model returning a transformers Cache, say) has no split to reuse: its row says so.

Results go to the "Warm checks of the HF families" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import pipecheck as pc

# private: traces are counted where pipecheck makes them, and a rank's split is made as a rank makes it
import pipecheck._split.pipe as pipe_module
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import split_on
from pipecheck._split.reuse import forget_splits

try:
    import real_models
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks import real_models
    from benchmarks._results import machine, write_section


class Traces:
    """Counts the driver's traces while installed (``with Traces() as traces: ...; traces.count``)."""

    def __enter__(self) -> Traces:
        self.count, self.real = 0, pipe_module.trace

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.real(*args, **kwargs)

        pipe_module.trace = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        pipe_module.trace = self.real


def rank_needs_no_trace(entry: real_models.Model, data: bytes) -> bool:
    """Whether a rank given the driver's recipe ``data`` cuts its model without tracing it."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("traced")

    real, pipe_module.trace = pipe_module.trace, refuse
    try:
        split_on(torch.device("cpu"), ModelFactory(entry.factory, seed=0), entry.args, entry.kwargs,
                 split_spec=entry.cut.get("split_spec"), policy=entry.cut.get("policy"), tracer="auto", recipe=data)
    except RuntimeError:
        return False
    finally:
        pipe_module.trace = real
    return True


def measure(name: str, world: pc.World, repeats: int) -> dict[str, Any]:
    entry = real_models.model(name, stages=2, train=False)

    def check() -> pc.Report:
        return pc.assert_equivalent(entry.factory, entry.args, entry.kwargs, runner="distributed", world=world,
                             n_microbatches=real_models.MICROBATCHES, **entry.cut)

    forget_splits()
    started = time.perf_counter()
    try:
        check()
    except pc.PipecheckError as err:
        return {"refused": f"{type(err).__name__}: {real_models.one_line(str(err))[:90]}",
                "first": time.perf_counter() - started}
    first = time.perf_counter() - started
    times, reports = [], []
    with Traces() as traces:
        for _ in range(repeats):
            begun = time.perf_counter()
            reports.append(check())
            times.append(time.perf_counter() - begun)
    phases = {phase: statistics.median(r.timings.get(phase, 0.0) for r in reports) for phase in ("split_s", "runner_s")}
    data = pc.split(ModelFactory(entry.factory, seed=0), entry.args, entry.kwargs, **entry.cut).recipe.dumps()
    ranks = data is not None and rank_needs_no_trace(entry, data)
    return {"first": first, "warm": statistics.median(times), **phases, "driver_traced": traces.count,
            "recipe": data is not None, "ranks": ranks, "reuses": traces.count == 0 and ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", default="hf")
    opts = parser.parse_args()
    rows, flagged = [], []
    with pc.World(2) as world:
        for name in real_models.names(opts.families):
            r = measure(name, world, opts.repeats)
            if "refused" in r:
                rows.append(f"| {name} | {r['first']:.2f} | - | - | - | - | - | - | refused: {r['refused']} |")
            else:
                verdict = "yes" if r["reuses"] else "**NO**"
                if not r["reuses"]:
                    flagged.append(name)
                rows.append(f"| {name} | {r['first']:.2f} | {r['warm']:.2f} | {r['split_s']:.2f} | {r['runner_s']:.2f} | "
                            f"{r['driver_traced']} | "
                            f"{'yes' if r['recipe'] else 'no'} | {'no' if r['ranks'] else 'yes'} | {verdict} |")
            print(rows[-1], flush=True)
    lines = [
        f"Command: `python benchmarks/bench_warm.py --repeats {opts.repeats} --families {opts.families}`  ",
        f"Machine: {machine()}; device: CPU",
        "",
        "Every HF family of the real-model suite (benchmarks/real_models.py: tiny config, its defaults, eval mode), "
        f"2 stages, {real_models.MICROBATCHES} micro-batches, runner='distributed' on one warm World of 2 ranks. "
        f"Seconds: the first check of the model, then the median of {opts.repeats} identical checks and of two "
        "of their phases (`Report.timings`: split_s, runner_s, the ranks' step); how many of "
        "those traced the model again in the driver, whether the driver's recipe pickles (what the ranks are "
        "sent), whether a rank given it traces anyway, and whether the family reuses its split.",
        "",
        "| family | first check | warm check | its split | its runner (ranks) | driver traces when warm | recipe sent | "
        "ranks trace | reuses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Not reusing: {', '.join(flagged) if flagged else 'none'}.",
    ]
    write_section("Warm checks of the HF families", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
