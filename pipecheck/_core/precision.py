"""How a check computes, as the engine under test does: one setting for eager, the reference and the runtime.

    pc.assert_equivalent(model, (x,), precision=pc.Precision(torch.bfloat16, grad_accumulation=torch.float32))
    pc.assert_equivalent(model, (x,), precision=pc.Precision(autocast=torch.bfloat16))

Mixed precision as engines run it: bfloat16 parameters whose gradients are summed over the
micro-batches in float32 (Megatron's ``main_grad``, DeepSpeed's bf16 optimizer), or ``torch.autocast``
over float32 parameters. Eager runs the same way, so that the check compares like with like and
catches an engine that does not do what it promised (a gradient accumulated in bfloat16 where float32
was promised).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from pipecheck.errors import InputError

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    """The precision a check runs in (``assert_equivalent(precision=...)``).

        pc.Precision(torch.bfloat16)                                   # = dtype=torch.bfloat16
        pc.Precision(torch.bfloat16, grad_accumulation=torch.float32)  # main_grad: bf16 weights, fp32 sums
        pc.Precision(autocast=torch.bfloat16)                          # torch.autocast over the model's weights

    ``dtype``: the parameters' and floating inputs' dtype (None: the model's own), as ``dtype=``.
    ``grad_accumulation``: each micro-batch's gradient is computed by its own backward and the gradients
    are summed in this dtype, and reported in it (None: autograd's accumulation, in the parameters' dtype).
    ``autocast``: every forward runs under ``torch.autocast(device, dtype=autocast)`` (None: none).
    The runner gets it as ``job.precision`` and must do the same: pipecheck's reference and runtime do.
    """

    dtype: torch.dtype | None = None
    grad_accumulation: torch.dtype | None = None
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        bad = [f"grad_accumulation={self.grad_accumulation!r}"] if self.grad_accumulation is not None and not (
            isinstance(self.grad_accumulation, torch.dtype) and self.grad_accumulation.is_floating_point) else []
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            bad.append(f"autocast={self.autocast!r}")
        if bad:
            raise InputError(f"pc.Precision({', '.join(bad)}): grad_accumulation must be a floating-point torch "
                             "dtype, autocast torch.bfloat16 or torch.float16. Fix: e.g. "
                             "pc.Precision(torch.bfloat16, grad_accumulation=torch.float32) or "
                             "pc.Precision(autocast=torch.bfloat16).")

    @property
    def mixed(self) -> bool:
        """Whether it asks more than a dtype of the engine (float32 sums or autocast)."""
        return self.grad_accumulation is not None or self.autocast is not None

    def forward(self, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
        """The context every forward runs in: ``torch.autocast`` where asked, else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.autocast)

    def describe(self) -> str:
        """``"gradients accumulated in float32"``, ``"autocast bfloat16"`` (a report's settings); "" for a dtype alone."""
        said = []
        if self.autocast is not None:
            said.append(f"autocast {_short(self.autocast)}")
        if self.grad_accumulation is not None:
            said.append(f"gradients accumulated in {_short(self.grad_accumulation)}")
        return ", ".join(said)


def check_dtype(dtype: object) -> None:
    """An InputError unless ``dtype`` is None or a floating-point torch dtype (``dtype=``, Precision's)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"dtype={dtype!r} is not a floating-point torch.dtype. Fix: pass one, e.g. "
                         "dtype=torch.float32 or torch.bfloat16 (or leave it out to keep the model's own).")


PLAIN = Precision()
"""The model's own dtype, no autocast, autograd's sums: what a check without ``precision=`` runs."""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_precision(dtype: torch.dtype | None, precision: Precision | None) -> Precision:
    """One Precision from ``dtype=`` and ``precision=`` (both only if they agree)."""
    if precision is None:
        return Precision(dtype)
    if not isinstance(precision, Precision):
        raise InputError(f"precision={precision!r} is not a pc.Precision. Fix: e.g. "
                         "precision=pc.Precision(torch.bfloat16, grad_accumulation=torch.float32).")
    if dtype is not None and precision.dtype is not None and dtype != precision.dtype:
        raise InputError(f"dtype={dtype} and precision=pc.Precision(dtype={precision.dtype}) disagree. Fix: give "
                         "the dtype once, in pc.Precision(dtype=...).")
    if dtype is not None and precision.dtype is None:
        return Precision(dtype, precision.grad_accumulation, precision.autocast)
    return precision
