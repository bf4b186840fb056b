"""Is each refusal runner='torch' makes before any rank starts one that torch itself makes?

    python benchmarks/torch_refusals.py [--cases 100]

For the zoo's models and ``--cases`` generated cases (``pst.pipeline_cases(runners=("torch",))``, derandomized; 1F1B,
4 micro-batches, one stage per rank), pipecheck's prediction (``unrunnable_by_torch``) is taken, then
the check is run through torch with the refusal turned off. Counted: refused where torch raises the
same error; refused where torch fails first with another error; refused where torch runs (a false
refusal: must be 0); torch raises it without a refusal (missed: must be 0).
"""

from __future__ import annotations

import argparse
import collections

from hypothesis import HealthCheck, given, settings
from pipecheck.fixtures import entries

import pipecheck as pc
from pipecheck import strategies as pst
from pipecheck._runners.job import Job  # private: the job the prediction reads

# private: the prediction itself, and turning it off to reach torch's own failure
from pipecheck._runners.torch_pipelining import driver as torch_driver
from pipecheck._split.inputs import prepare_inputs  # private: inputs bound as a check binds them

# private: the model built as a check builds it
from pipecheck._split.model_factory import ModelFactory
from pipecheck.strategies._internal.builder import make_inputs  # private: a generated case's inputs

PREDICT = torch_driver.unrunnable_by_torch
TORCH_SAYS = "unexpected keyword argument"


def predicted(model: object, args: tuple, kwargs: dict, n: int, **cut: object) -> bool:
    factory = ModelFactory(model)
    inputs = prepare_inputs(factory(), args, kwargs, None)
    job = Job(model=factory, args=inputs.args, kwargs=inputs.kwargs, n_microbatches=n, **cut)
    return bool(PREDICT(job, job.structure()))


def torch_outcome(model: object, args: tuple, kwargs: dict, n: int, **extra: object) -> str:
    try:
        pc.assert_equivalent(model, args, kwargs, runner="torch", n_microbatches=n, **extra)
        return "runs"
    except (pc.EquivalenceError, pc.PowerError):
        return "runs"  # it ran; its numbers are another matter
    except pc.EngineError as err:
        return "same" if TORCH_SAYS in str(err) else "other"
    except pc.PipecheckError:
        return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100)
    options = parser.parse_args()
    torch_driver.unrunnable_by_torch = lambda job, pipe: []  # the runs below reach torch's own failure
    counts: collections.Counter[str] = collections.Counter()

    def count(refused: bool, outcome: str) -> None:
        counts[("refused, torch " if refused else "not refused, torch ") + outcome] += 1

    for entry in entries(()):
        style = entry.cut_styles[0]
        args, kwargs = entry.inputs()
        refused = predicted(entry.factory(style), args, kwargs, 4, **entry.cut(style))
        count(refused, torch_outcome(entry.factory(style), args, kwargs, 4, loss_fn=entry.loss_fn,
                                     target=entry.target(), **entry.cut(style)))
    cases: list[object] = []

    @settings(max_examples=options.cases, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(pst.pipeline_cases(runners=("torch",)))  # no random ops: torch's runner does not follow the contract
    def collect(case: object) -> None:
        cases.append(case)

    collect()
    for case in cases:
        args, tensors = make_inputs(case.spec)  # type: ignore[attr-defined]
        kwargs = {name: pc.Replicated(value) if case.spec.input(name).role == "replicated" else value  # type: ignore[attr-defined]
                  for name, value in tensors.items()}
        split_spec = dict(case.split_spec)  # type: ignore[attr-defined]
        refused = predicted(case.model_factory(), args, kwargs, 4, split_spec=split_spec)  # type: ignore[attr-defined]
        count(refused, torch_outcome(case.model_factory(), args, kwargs, 4, split_spec=split_spec,  # type: ignore[attr-defined]
                                     schedule="1f1b"))
    for what, n in sorted(counts.items()):
        print(f"{n:4d}  {what}")
    bad = counts["refused, torch runs"] + counts["not refused, torch same"]
    print(f"false refusals + missed: {bad} (must be 0)")


if __name__ == "__main__":  # checks start worker processes
    main()
