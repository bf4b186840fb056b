"""One-line hints for failures whose pattern is recognisable.

    hint = diagnose_grad(test, truth, n_microbatches, shares)   # "tied parameter not synchronised: ..."

Each recogniser compares the runner's tensor with the truth under a loose
closeness (a hint, not a verdict): a gradient equal to one stage's share of a
tied parameter, a gradient off by a factor of n_microbatches, a gradient that
never arrived, outputs whose micro-batches are permuted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _real64(t: torch.Tensor) -> torch.Tensor:
    """On the host in float64; a complex tensor as its (real, imaginary) pairs."""
    t = t.detach().cpu()
    return (torch.view_as_real(t) if t.is_complex() else t).double()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    a, b = _real64(a), _real64(b)
    scale = max(b.abs().max().item(), a.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= rel * scale


def _rel(dtype: torch.dtype) -> float:
    return max(1e-4, 16 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4


def diagnose_grad(test: torch.Tensor, truth: torch.Tensor, n_microbatches: int,
                  shares: Sequence[tuple[int, torch.Tensor]] = ()) -> str | None:
    """``shares``: (stage, that stage's share of the gradient) for a tied parameter."""
    rel = _rel(test.dtype)
    test64, truth64 = _real64(test), _real64(truth)
    if truth64.abs().max().item() > 0 and test64.abs().max().item() == 0:
        return ("gradient is zero: no gradient reached this tensor (a skip connection's or a stage "
                "input's gradient was dropped upstream?)")
    if len(shares) > 1:
        for stage, share in shares:
            if _close(test64, share, rel):
                holders = ", ".join(str(s) for s, _ in shares)
                return (f"tied parameter not synchronised: gradient equals stage {stage}'s share only; "
                        f"stages {holders} hold replicas and their gradients must be summed (all-reduce)")
    denom = (truth64 * truth64).sum().item()
    if denom > 0 and n_microbatches > 1:
        factor = (test64 * truth64).sum().item() / denom
        if _close(test64, factor * truth64, rel):
            if abs(factor - n_microbatches) <= rel * n_microbatches:
                return (f"gradient scaling: gradient is n_microbatches (={n_microbatches}) times too large; "
                        "each micro-batch's loss must be divided by n_microbatches")
            if abs(factor - 1 / n_microbatches) <= rel:
                return (f"gradient scaling: gradient is n_microbatches (={n_microbatches}) times too small; "
                        "the loss was divided by n_microbatches twice")
    return None


def diagnose_output(test: torch.Tensor, truth: torch.Tensor, n_microbatches: int) -> str | None:
    """Recognise micro-batch outputs merged in the wrong order."""
    if n_microbatches < 2 or test.dim() == 0 or test.shape != truth.shape or test.shape[0] % n_microbatches:
        return None
    rel = _rel(test.dtype)
    test_chunks = _real64(test).chunk(n_microbatches)
    truth_chunks = _real64(truth).chunk(n_microbatches)
    source = []
    for chunk in test_chunks:
        matches = [j for j, ref in enumerate(truth_chunks) if _close(chunk, ref, rel)]
        if not matches:
            return None
        source.append(matches[0])
    if source != list(range(n_microbatches)) and sorted(source) == list(range(n_microbatches)):
        moved = ", ".join(f"{i}<-{j}" for i, j in enumerate(source) if i != j)
        return (f"outputs permuted across micro-batches: merged position <- micro-batch: {moved}; "
                "merge micro-batch outputs in micro-batch order")
    return None



def dropped_skip_hint(name: str, producer: int, consumer: int) -> str:
    return (f"skip-connection gradient dropped: the gradients match a run in which the gradient of "
            f"{name!r} (stage {producer} -> stage {consumer}) never flows back; send it straight back "
            "to the producing stage")


def matches(test: torch.Tensor, candidate: torch.Tensor) -> bool:
    """Loose equality for what-if runs (a hint, not a verdict)."""
    return test.shape == candidate.shape and _close(test.detach().cpu(), candidate.detach().cpu(), _rel(test.dtype))
