"""Losses for checks. The default is a seeded random projection of every output element.

    target = projection_target(eager_outputs, seed=0)
    loss = projection_loss(outputs, target)
    loss_of = MicrobatchLoss(loss_fn, target, n_microbatches)   # what every runner computes
    loss_of(2, outputs_of_microbatch_2)

Never ``.sum()``: a sum gives the same gradient under a permutation of
micro-batches and hides real bugs. The projection weights form a *target*
with the outputs' full-batch shapes, so they are split into micro-batches like
any target, and each micro-batch sees different weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._split.microbatch import split_microbatches
from pipecheck.errors import InputError, LossError, PipecheckError, first_line

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs_of_a_microbatch, target_of_that_microbatch) -> scalar tensor``."""


def _projectable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def projection_target(outputs: Any, seed: int = 0) -> Any:
    """Random weights (std 1/sqrt(numel)) shaped like each floating output leaf; 0 elsewhere. A
    complex leaf gets real weights for its (real, imaginary) pairs (``torch.view_as_real``'s shape):
    the loss stays real, and both parts of every element are projected."""
    generator = torch.Generator().manual_seed(seed)
    leaves, spec = pytree.tree_flatten(outputs)
    weights = []
    for leaf in leaves:
        if _projectable(leaf):
            shape = (*leaf.shape, 2) if leaf.is_complex() else leaf.shape
            w = torch.randn(shape, generator=generator, dtype=torch.float64) / max(leaf.numel(), 1) ** 0.5
            weights.append(w.to(device=leaf.device, dtype=leaf.real.dtype if leaf.is_complex() else leaf.dtype))
        else:
            weights.append(torch.zeros(()))
    return pytree.tree_unflatten(weights, spec)


def projection_loss(outputs: Any, target: Any) -> torch.Tensor:
    """Sum over floating output leaves of ``(out * w).sum()``; ``target`` from projection_target."""
    out_leaves = pytree.tree_leaves(outputs)
    weight_leaves = pytree.tree_leaves(target)
    if len(out_leaves) != len(weight_leaves):
        raise LossError("projection_loss: the target does not match the outputs' structure. "
                        "Fix: build it with projection_target(outputs) on the same model.")
    terms = [((torch.view_as_real(o.resolve_conj()) if o.is_complex() else o) * w).sum()
             for o, w in zip(out_leaves, weight_leaves) if _projectable(o)]
    if not terms:
        raise LossError("the model has no floating-point output to take gradients of. "
                        "Fix: pass loss_fn=..., or check_grads=False.")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def model_loss(outputs: Any, target: Any = None) -> torch.Tensor:
    """The loss the model computes itself, as HuggingFace models do when called with ``labels=``:

        pc.assert_equivalent(make_model, (ids,), {"labels": labels}, loss_fn=pc.losses.model_loss)

    ``outputs.loss`` (a ``ModelOutput``), ``outputs["loss"]`` (a dict) or ``outputs[0]`` (a tuple, as with
    ``return_dict=False``). The labels are a keyword input, split into micro-batches like every input, and
    reach the stage that computes the loss. The check's loss is then the mean of the micro-batches' own
    losses, each the model's reduction over its micro-batch (for a causal LM, the mean over its tokens whose
    label is not -100): the full batch's loss when every micro-batch has as many valid tokens, and what eager
    is run with in any case. ``target`` is not used (the labels are the target)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor) \
            and outputs[0].numel() == 1:
        loss = outputs[0]
    if loss is None:
        seen = (f"{type(outputs).__name__} with {list(outputs.keys())}" if isinstance(outputs, dict)
                else _describe(outputs))
        raise LossError(f"loss_fn=pc.losses.model_loss found no loss in the model's outputs ({seen}). "
                        "Fix: pass the labels the model computes its loss from as a keyword input, e.g. "
                        "kwargs={'labels': ids}, or give a loss_fn of your own.")
    return loss


def check_scalar_loss(loss: Any, loss_fn: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        seen = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossError(f"loss_fn {_name(loss_fn)!r} returned {seen}; it must return a "
                        "scalar tensor. Fix: reduce it (e.g. reduction='mean' or .mean()).")
    # A 0-dim loss is kept as it is, not made a view of itself: torch's zero-bubble schedules detach the
    # loss in place after its input-gradient backward, which a view refuses ("Can't detach views in-place").
    return loss if loss.dim() == 0 else loss.reshape(())


DEFAULT_SEED = 0x5EED


def default_microbatch_target(outputs_mb: Any, microbatch: int) -> Any:
    """Projection weights for one micro-batch when a runner is used without loss_fn.

    Seeded by the micro-batch index, so micro-batches see different weights.
    (``assert_equivalent`` always passes full-batch weights as an explicit target.)
    """
    return projection_target(outputs_mb, seed=DEFAULT_SEED + microbatch)


LOSS_REDUCTIONS = {
    "mean": "the mean of the micro-batches' losses (each loss_fn's own reduction, e.g. a mean)",
    "token_mean": "every token's loss summed over all micro-batches, divided by the number of valid tokens "
                  "(target != ignore_index) in all of them; loss_fn returns per-token losses (reduction='none')",
    "sum": "the sum of the micro-batches' losses",
}
"""The loss conventions a check can hold an engine to (``loss_reduction=``), over one optimizer step."""


def check_loss_reduction(value: Any) -> str:
    if isinstance(value, str) and value in LOSS_REDUCTIONS:
        return value
    raise InputError(f"loss_reduction={value!r} is not known. Fix: use one of {list(LOSS_REDUCTIONS)}: "
                     + "; ".join(f"{name!r}: {what}" for name, what in LOSS_REDUCTIONS.items()) + ".")


@dataclass(frozen=True)
class Reduction:
    """How one schedule step's micro-batch losses add up to the loss its gradients are of.

        reduction = Reduction.of("token_mean", targets, n_microbatches=4, ignore_index=-100)
        loss = sum(reduction.weight * loss_of(mb, out) for mb, out in enumerate(outputs))

    Every micro-batch's loss is multiplied by ``weight`` before its backward (torch's schedules: 1/n).
    ``per_token``: ``loss_fn`` returns per-token losses and a micro-batch's loss is their sum.
    ``uneven``: micro-batches may differ in size (the mean of means weighs them equally: not there).
    """

    weight: float
    per_token: bool = False
    uneven: bool = False

    @staticmethod
    def of(name: str, targets: Sequence[Any], n_microbatches: int, ignore_index: int = -100) -> Reduction:
        """The reduction ``name`` over one optimizer step, whose schedule steps have ``targets``."""
        n_total = n_microbatches * len(targets)
        if name == "mean":
            return Reduction(1.0 / n_total)
        if name == "sum":
            return Reduction(1.0, uneven=True)
        tokens = sum(valid_tokens(target, ignore_index) for target in targets)
        if tokens == 0:
            raise InputError(f"loss_reduction='token_mean' but no target element differs from "
                             f"ignore_index={ignore_index}: there is no token to average over. Fix: give targets "
                             "with valid tokens, or the ignore_index your loss_fn uses.")
        return Reduction(1.0 / tokens, per_token=True, uneven=True)


def valid_tokens(target: Any, ignore_index: int) -> int:
    """How many elements of ``target``'s tensors are not ``ignore_index`` (the tokens a loss averages over)."""
    leaves = [leaf for leaf in pytree.tree_leaves(target) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise InputError("loss_reduction='token_mean' needs a target of token labels (a tensor) to count the "
                         f"valid tokens in; the target is {type(target).__name__}. Fix: pass target=labels.")
    return sum(int((leaf != ignore_index).sum()) for leaf in leaves)


class MicrobatchLoss:
    """The loss of one micro-batch, as every pipecheck runner computes it.

    ``loss_fn(out_mb, target_mb)`` with ``target`` split on dim 0 like the inputs;
    without ``loss_fn``, the projection loss with :func:`default_microbatch_target`
    weights (a runner used on its own, not through ``assert_equivalent``, which
    always passes ``loss_fn`` and a full-batch target).
    """

    def __init__(self, loss_fn: LossFn | None, target: Any, n_microbatches: int,
                 reduction: Reduction | None = None) -> None:
        self.loss_fn = loss_fn or projection_loss
        self.default = loss_fn is None
        self.per_token = reduction is not None and reduction.per_token
        uneven = reduction is not None and reduction.uneven
        self.targets = (split_microbatches(target, n_microbatches, "target", uneven=uneven)
                        if target is not None and not self.default else [None] * n_microbatches)

    def target(self, microbatch: int, outputs: Any) -> Any:
        return default_microbatch_target(outputs, microbatch) if self.default else self.targets[microbatch]

    def __call__(self, microbatch: int, outputs: Any) -> torch.Tensor:
        target = self.target(microbatch, outputs)
        try:
            loss = self.loss_fn(outputs, target)
        except PipecheckError:
            raise
        except Exception as err:
            first = first_line(err)
            raise LossError(
                f"loss_fn {_name(self.loss_fn)!r} raised {type(err).__name__}: {first} on micro-batch "
                f"{microbatch} of {len(self.targets)} (outputs: {_describe(outputs)}; target: "
                f"{_describe(target)}). Fix: "
                + ("no target was given, so loss_fn was called with target=None: pass target=... (split on dim 0 "
                   "like the inputs), or make loss_fn ignore it." if target is None and not self.default else
                   "make loss_fn(outputs, target) work on one micro-batch: outputs and target are split on dim 0, "
                   "so each call sees 1/n_microbatches of the batch.")
            ) from err
        if self.per_token:
            return per_token_sum(loss, self.loss_fn, target)
        return check_scalar_loss(loss, self.loss_fn)


def per_token_sum(loss: Any, loss_fn: Any, target: Any) -> torch.Tensor:
    """The sum of one micro-batch's per-token losses (``loss_reduction='token_mean'``)."""
    n_target = sum(leaf.numel() for leaf in pytree.tree_leaves(target) if isinstance(leaf, torch.Tensor))
    if not isinstance(loss, torch.Tensor) or (loss.numel() == 1 and n_target > 1):
        seen = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossError(f"loss_reduction='token_mean' but loss_fn {_name(loss_fn)!r} returned {seen} for a target "
                        f"of {n_target} tokens: it must return every token's loss, unreduced, so that pipecheck "
                        "divides their sum by the valid tokens of the whole step. Fix: reduction='none' (e.g. "
                        "F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction='none', "
                        "ignore_index=-100)).")
    return loss.sum()


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or fn)


def _describe(value: Any) -> str:
    """``"Tensor(2, 4) float32"``; a pytree's tensors in order; other values by type."""
    leaves = pytree.tree_leaves(value)
    if len(leaves) > 4:
        return f"{type(value).__name__} of {len(leaves)} leaves"
    described = [f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
                 if isinstance(leaf, torch.Tensor) else type(leaf).__name__ for leaf in leaves]
    text = ", ".join(described) or "nothing"
    return text if len(leaves) == 1 and leaves[0] is value else f"{type(value).__name__}: {text}"
