"""The one exception family of pipecheck.

Every error a user can trigger derives from :class:`PipecheckError`. Messages
state the rule, the values seen and the fix.
"""

from __future__ import annotations


class PipecheckError(Exception):
    """Base class of every error pipecheck raises on purpose."""


class SplitError(PipecheckError):
    """The model could not be cut into stages as asked (bad split_spec, policy, or cut)."""


class TraceError(SplitError):
    """The model could not be traced by the chosen tracer."""


class InputError(PipecheckError):
    """Inputs, kwargs, targets or micro-batch settings do not fit the model."""


class LossError(PipecheckError):
    """The loss function returned something that is not a scalar tensor."""


class ScheduleError(PipecheckError):
    """A pipeline schedule is malformed or would deadlock."""


class WorldError(PipecheckError):
    """A worker process of a :class:`pipecheck.World` failed, hung or died."""


class EngineError(PipecheckError):
    """The pipeline engine under test failed to run the job (not a numerical mismatch)."""


class NonFiniteError(PipecheckError):
    """The eager model itself produced NaN/Inf, so no comparison is meaningful."""


class EquivalenceError(AssertionError, PipecheckError):
    """The pipelined run does not match the eager model.

    ``str(err)`` is the readable failure table; ``err.report`` is the full
    :class:`pipecheck.Report`.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
