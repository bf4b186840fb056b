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
    return (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).double()


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
    source: list[int] = []
    for chunk in test_chunks:
        matches = [j for j, ref in enumerate(truth_chunks) if _close(chunk, ref, rel)]
        if not matches:
            return None
        source.append(len(source) if len(source) in matches else matches[0])  # its own, where alike
    if source != list(range(n_microbatches)) and sorted(source) == list(range(n_microbatches)):
        moved = ", ".join(f"{i}<-{j}" for i, j in enumerate(source) if i != j)
        return (f"outputs permuted across micro-batches: merged position <- micro-batch: {moved}; "
                "merge micro-batch outputs in micro-batch order")
    if source != list(range(n_microbatches)):
        moved = ", ".join(f"{i}<-{j}" for i, j in enumerate(source) if i != j)
        return (f"outputs of one micro-batch repeated: merged position <- micro-batch: {moved} (a stage or the "
                "merge read another micro-batch's value: an index or a FIFO off by one)")
    return None



def dropped_skip_hint(name: str, producer: int, consumer: int) -> str:
    return (f"skip-connection gradient dropped: the gradients match a run in which the gradient of "
            f"{name!r} (stage {producer} -> stage {consumer}) never flows back; send it straight back "
            "to the producing stage")


def matches(test: torch.Tensor, candidate: torch.Tensor) -> bool:
    """Loose equality for what-if runs (a hint, not a verdict)."""
    return test.shape == candidate.shape and _close(test.detach().cpu(), candidate.detach().cpu(), _rel(test.dtype))


def microbatch_weights(test: torch.Tensor, shares: Sequence[torch.Tensor]) -> list[float] | None:
    """The weights w with ``test = sum_k w_k * shares[k]`` (eager: every w_k = 1), when the shares are
    independent enough to tell apart and the fit is close; else None."""
    if len(shares) < 2 or any(share.shape != test.shape for share in shares) or test.numel() <= len(shares):
        return None
    basis = torch.stack([_real64(share).flatten() for share in shares], dim=1)
    target = _real64(test).flatten()
    if not (bool(torch.isfinite(basis).all()) and bool(torch.isfinite(target).all())):
        return None
    singular = torch.linalg.svdvals(basis)
    if singular[-1].item() <= 1e-6 * singular[0].item():
        return None  # two micro-batches' gradients (nearly) alike: their weights cannot be told apart
    weights = torch.linalg.lstsq(basis, target.unsqueeze(1)).solution.squeeze(1)
    if not _close(basis @ weights, target, _rel(test.dtype)):
        return None
    # The fit must explain the failure: far closer than eager's weights (1 each) come, or the failure is
    # noise (a low-precision runner) that any weights near 1 absorb.
    fitted = (basis @ weights - target).norm().item()
    eager = (basis.sum(dim=1) - target).norm().item()
    if not fitted <= 0.1 * eager:
        return None
    return [float(w) for w in weights]


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-3 * max(1.0, abs(b))


def _weight(w: float) -> str:
    """A fitted weight as read: a whole number where it is one (fit noise dropped), else 3 digits."""
    return str(round(w) + 0) if _near(w, float(round(w))) else f"{w:.3g}"


def _mbs(mbs: Sequence[int]) -> str:
    return ("micro-batch " if len(mbs) == 1 else "micro-batches ") + ", ".join(map(str, mbs))


def weights_hint(weights: Sequence[float]) -> str | None:
    """What per-micro-batch weights of a gradient mean (eager: 1 each), in words; None if they are eager's."""
    n = len(weights)
    if all(_near(w, 1.0) for w in weights):
        return None
    shown = "(" + ", ".join(_weight(w) for w in weights) + ")"
    if all(_near(w, weights[0]) for w in weights):
        factor = weights[0]
        if _near(factor, float(n)) or _near(factor, 1.0 / n) or _near(factor, 0.0):
            return None  # the scaling and zero hints say it
        return (f"gradient scaling: every micro-batch's gradient is scaled by {factor:.4g} (a uniform factor: a loss "
                "normalised by the wrong count, such as one micro-batch's tokens instead of the step's, or a loss "
                "scale not undone)")
    lost = [k for k, w in enumerate(weights) if _near(w, 0.0)]
    if lost == list(range(n - 1)) and _near(weights[-1], 1.0):
        return (f"gradient accumulation: only the last micro-batch's gradient survives, weights {shown} where eager "
                "has 1 each: gradients were overwritten or zeroed between micro-batches instead of accumulated")
    meanings = []
    if lost:
        meanings.append(f"{_mbs(lost)} missing (never accumulated, or overwritten by a later one)")
    twice = [k for k, w in enumerate(weights) if _near(w, 2.0)]
    if twice:
        meanings.append(f"{_mbs(twice)} counted twice")
    for k, w in enumerate(weights):
        if k not in lost and k not in twice and not _near(w, 1.0):
            first = " (the first accumulation step)" if k == 0 else ""
            meanings.append(f"micro-batch {k} weighted {_weight(w)}{first}")
    return (f"gradient accumulation: the gradient is the micro-batches' eager gradients weighted {shown} where "
            f"eager has 1 each: {'; '.join(meanings)}")
