"""``assert_equivalent``: does a pipelined run compute what the eager model computes?

    report = pc.assert_equivalent(model, (x,), split_spec=spec, n_microbatches=4,
                                  runner="reference")

Runs the eager model (per micro-batch, as a pipeline sees it) in the check's
dtype and an fp64 copy as ground truth, runs the runner on the same job, and
compares every output leaf, the loss, every parameter gradient and the
gradients of inputs that require grad. Raises :class:`EquivalenceError` with
the failure table, or returns the :class:`Report`.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._compare import compare_all, output_name
from pipecheck._errors import (
    EngineError,
    EquivalenceError,
    InputError,
    NonFiniteError,
    PipecheckError,
)
from pipecheck._job import Job, LossFn, ModelFactory, cast_inputs, seeded
from pipecheck._microbatch import merge_microbatches, split_microbatches
from pipecheck._numerics import ToleranceLike, check_tolerance, nonfinite
from pipecheck._report import Report
from pipecheck._result import StepResult
from pipecheck._runners import resolve_runner
from pipecheck._trace import SplitSpec, _bind_signature, check_tracer
from pipecheck.losses import check_scalar_loss, projection_loss, projection_target
from pipecheck.policies import Policy


def eager_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None,
               target: Any, n_microbatches: int, check_grads: bool) -> tuple[StepResult, Any]:
    """The model run eagerly on each micro-batch; loss = mean of per-micro-batch losses.

    Returns the result and the target used (the projection weights when ``loss_fn`` is None).
    """
    bound = _bind_signature(model, args, kwargs)  # unknown kwargs: InputError, not forward's TypeError
    chunks = split_microbatches(dict(bound.arguments), n_microbatches)  # errors name the input
    calls = [inspect.BoundArguments(bound.signature, chunk) for chunk in chunks]
    outputs = [_call_eager(model, call, n_microbatches) for call in calls]
    merged = merge_microbatches(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, outputs))
    if loss_fn is None:
        loss_fn, target = projection_loss, projection_target(merged)
    targets = split_microbatches(target, n_microbatches, "target") if target is not None else [None] * n_microbatches
    losses = [check_scalar_loss(loss_fn(out, tgt), loss_fn) for out, tgt in zip(outputs, targets)]
    loss = torch.stack(losses).mean()
    grads: dict[str, torch.Tensor] = {}
    input_grads: dict[str, torch.Tensor] = {}
    if check_grads:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named_inputs = _grad_inputs(model, args, kwargs)
        wrt = [p for _, p in params] + [t for _, t in named_inputs]
        if wrt and loss.requires_grad:
            got = torch.autograd.grad(loss, wrt, allow_unused=True)
            grads = {n: g for (n, _), g in zip(params, got) if g is not None}
            input_grads = {n: g for (n, _), g in zip(named_inputs, got[len(params):]) if g is not None}
    return StepResult(merged, loss.detach(), grads, input_grads), target


def _call_eager(model: nn.Module, call: inspect.BoundArguments, n_microbatches: int) -> Any:
    try:
        return model(*call.args, **call.kwargs)
    except PipecheckError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise InputError(
            f"the eager model failed on one micro-batch of its inputs ({type(err).__name__}: {first}). "
            f"With n_microbatches={n_microbatches} each call sees 1/{n_microbatches} of the batch. Fix: make "
            "forward work for any batch size (no hard-coded batch), or use n_microbatches=1."
        ) from None


def _check_deterministic(factory: ModelFactory, args: tuple[Any, ...], kwargs: dict[str, Any],
                         n_microbatches: int, seed: int) -> None:
    """Refuse a model whose outputs depend on the RNG: no pipeline can match it, and its spread
    would widen the auto tolerance until a wrong answer passes."""
    model = factory()
    bound = _bind_signature(model, args, kwargs)
    first = split_microbatches(dict(bound.arguments), n_microbatches)[0]
    runs = []
    for offset in (1, 2):
        call = inspect.BoundArguments(bound.signature, _fresh(first))  # a forward may write into its inputs
        with seeded(seed + offset), torch.no_grad():
            runs.append(pytree.tree_leaves(_call_eager(model, call, n_microbatches)))
    for a, b in zip(*runs):
        if isinstance(a, torch.Tensor) and not torch.equal(a, b) and not (a.isnan() & b.isnan()).any():
            raise InputError(
                f"{type(model).__name__} is not deterministic: two eager runs with different RNG seeds give "
                "different outputs (dropout or another random op in train mode?). No pipeline can match it. "
                "Fix: check the model in eval mode (model.eval()) or without its random ops."
            )


def _grad_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return [(name, value) for name, value in bound.arguments.items()
            if isinstance(value, torch.Tensor) and value.requires_grad]


def _fresh(value: Any) -> Any:
    """Tensors copied (keeping requires_grad), so no run sees what another run's forward wrote."""
    return pytree.tree_map(
        lambda v: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v, value)


def _to64(value: Any) -> Any:
    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().to(torch.float64).requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(cast, value)


def _check_nonfinite(eager: StepResult) -> None:
    bad = [name for name, value in _named_tensors(eager) if isinstance(value, torch.Tensor) and nonfinite(value)]
    if bad:
        raise NonFiniteError(
            f"the eager model itself produced NaN/Inf in: {', '.join(bad)}. No comparison is meaningful. "
            "Fix: check the model and inputs (overflow in float16? log of zero?) before checking the pipeline."
        )


def _named_tensors(result: StepResult) -> list[tuple[str, Any]]:
    named = [(output_name(path), leaf) for path, leaf in pytree.tree_flatten_with_path(result.outputs)[0]]
    if result.loss is not None:
        named.append(("loss", result.loss))
    named += [(f"grad {fqn}", g) for fqn, g in result.grads.items()]
    named += [(f"grad input {name}", g) for name, g in result.input_grads.items()]
    return named


def assert_equivalent(
    model: nn.Module | Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
    split_spec: SplitSpec | None = None, policy: Policy | None = None, loss_fn: LossFn | None = None,
    target: Any = None, n_microbatches: int = 1, schedule: str = "1f1b", world_size: int | None = None,
    runner: Any = "distributed", device: str | None = None, dtype: torch.dtype | None = None,
    tolerance: ToleranceLike = "auto", check_grads: bool = True, seed: int = 0, tracer: str = "fx",
    stages_per_rank: int = 1, timeout: float | None = None, options: Mapping[str, Any] | None = None,
) -> Report:
    """Check that ``runner`` computes the eager model's outputs, loss and gradients.

        pc.assert_equivalent(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING},
                             n_microbatches=4, runner="reference")

    Raises :class:`pipecheck.EquivalenceError` (an AssertionError) with a table naming
    every failing tensor, or returns the :class:`pipecheck.Report`.
    """
    tolerance = check_tolerance(tolerance)
    check_tracer(tracer)
    if loss_fn is None and target is not None:
        raise InputError("target was given without loss_fn. Fix: pass loss_fn=..., or drop target to use "
                         "the default random-projection loss.")
    runner_name, run = resolve_runner(runner)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    call_kwargs: dict[str, Any] = dict(kwargs or {})
    factory = ModelFactory(model, dtype=dtype, device=device, seed=seed)
    args, target = cast_inputs(args, dtype, device), cast_inputs(target, dtype, device)
    call_kwargs = cast_inputs(call_kwargs, dtype, device)
    timings: dict[str, float] = {}

    started = time.perf_counter()
    with seeded(seed):  # the user's RNG streams are left as they were
        eager_args, eager_kwargs = _fresh((args, call_kwargs))
        eager, target_used = eager_step(factory(), eager_args, eager_kwargs, loss_fn, target, n_microbatches,
                                        check_grads)
    timings["eager_s"] = time.perf_counter() - started
    probe_args, probe_kwargs = _fresh((args, call_kwargs))
    _check_deterministic(factory, probe_args, probe_kwargs, n_microbatches, seed)
    started = time.perf_counter()
    ref64, _ = eager_step(factory().to(torch.float64), _to64(args), _to64(call_kwargs), loss_fn or projection_loss,
                          _to64(target_used), n_microbatches, check_grads)
    timings["fp64_s"] = time.perf_counter() - started
    _check_nonfinite(eager)

    args, call_kwargs = _fresh((args, call_kwargs))  # a forward that writes into its inputs never reaches the user's
    job = Job(model=factory, args=args, kwargs=call_kwargs, split_spec=split_spec, policy=policy, tracer=tracer,
              loss_fn=loss_fn or projection_loss, target=target_used, n_microbatches=n_microbatches,
              schedule=schedule, world_size=world_size, stages_per_rank=stages_per_rank,
              device=str(device or "cpu"), timeout=timeout, options=dict(options or {}))
    pipe = job.split()  # for stage attribution and hints; the splitter is cheap
    started = time.perf_counter()
    try:  # the runner gets its own copy: what it changes must not alter the diagnosis
        result = run(dataclasses.replace(job, kwargs=dict(job.kwargs), options=dict(job.options)))
    except PipecheckError:
        raise
    except Exception as err:
        raise EngineError(f"runner {runner_name!r} failed to run the job: {type(err).__name__}: {err}") from err
    timings["runner_s"] = time.perf_counter() - started
    if not isinstance(result, StepResult):
        raise EngineError(f"runner {runner_name!r} returned {type(result).__name__}; a runner must return "
                          "pc.StepResult(outputs, loss, grads).")

    rows, hints = compare_all(pipe, job, result, eager, ref64, tolerance, check_grads)
    report = Report(runner_name, rows, hints, tolerance if isinstance(tolerance, str) else str(tolerance),
                    str(eager_dtype(eager)).replace("torch.", ""), n_microbatches, pipe.num_stages, timings)
    if not report.ok:
        raise EquivalenceError(report.failure_text(), report)
    return report


def eager_dtype(result: StepResult) -> torch.dtype:
    for leaf in pytree.tree_leaves(result.outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.float32
