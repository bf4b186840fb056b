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


class WorldStartError(WorldError):
    """The worker processes of a :class:`pipecheck.World` could not be started."""


class JobPickleError(WorldError):
    """A job (its function, arguments or keyword arguments) cannot be sent to the ranks."""


class RankFailedError(WorldError):
    """A rank raised while running a job; ``rank``, ``stage`` and ``traceback`` say where."""

    def __init__(
        self, message: str, rank: int = -1, stage: int | None = None, traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage
        self.traceback = traceback


class RankTimeoutError(WorldError):
    """Some ranks did not finish a job in time; ``stacks`` maps every rank to its Python stack."""

    def __init__(
        self,
        message: str,
        ranks: tuple[int, ...] = (),
        stacks: dict[int, str] | None = None,
        timeout: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.stacks = dict(stacks or {})
        self.timeout = timeout


class RankDiedError(WorldError):
    """A rank's process exited during a job (os._exit, a signal, a crash)."""

    def __init__(
        self, message: str, rank: int = -1, exitcode: int | None = None, stage: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.stage = stage
