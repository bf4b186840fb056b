"""The one exception family of pipecheck, and the record a rank's exception travels as (public).

    try:
        pc.assert_equivalent(model, (x,), runner="torch", n_microbatches=4)
    except pipecheck.errors.RankTimeoutError as err:   # also pc.RankTimeoutError
        print(err.ranks, err.stacks)

Every error a user can trigger derives from :class:`PipecheckError`. Messages
state the rule, the values seen and the fix. An exception raised on a worker
rank crosses to the driver as a :class:`RankError`: typed fields, never text
to be parsed back.
"""

from __future__ import annotations

import traceback as _traceback
import types
from dataclasses import dataclass
from pathlib import Path

# pipecheck's adapters: the rank-side modules that call an engine's or torch's own API, where a release
# that drops or changes that API fails.
_PACKAGE = Path(__file__).resolve().parent
_ADAPTERS = {_PACKAGE.joinpath(*name.split("/")).with_suffix(".py") for name in (
    "_runners/torch_pipelining/rank", "_schedule/torch_classes", "_runners/torchtitan/rank",
    "_runners/deepspeed/rank", "_runners/deepspeed/layers", "_runners/rank_side")}
# The packages whose API the adapters call.
_ENGINE_PACKAGES = ("torch", "deepspeed", "torchtitan")


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, as data: picklable whatever the exception was.

    ``causes`` are the ``(type, message)`` of its ``__cause__`` chain, outermost
    first (torch wraps a stage's error as "[Stage 0] failed to run forward").
    """

    exc_type: str  # "TypeError", "torch.distributed.DistBackendError"
    message: str
    rank: int
    stage: int | None
    action: str | None
    traceback: str
    causes: tuple[tuple[str, str], ...] = ()
    in_pipecheck: bool = False  # raised by pipecheck's own adapter code calling an engine's or torch's API
    raised_at: str = ""  # the innermost frame: "torch/fx/interpreter.py:1423 in run_from"

    @classmethod
    def from_exception(cls, error: BaseException, rank: int, stage: int | None, action: str | None,
                       traceback: str | None = None) -> RankError:
        causes: list[tuple[str, str]] = []
        cause = error.__cause__
        while cause is not None and len(causes) < 8:
            causes.append((_type_name(cause), str(cause)))
            cause = cause.__cause__
        text = traceback if traceback is not None else "".join(_traceback.format_exception(error))
        return cls(_type_name(error), str(error), rank, stage, action, text, tuple(causes),
                   raised_in_pipecheck(error), _raised_at(error))

    @property
    def summary(self) -> str:
        """``"ValueError: bad shape"``: the type and the first line of the message."""
        first = first_line(self.message)
        return f"{self.exc_type}: {first}" if first else self.exc_type


def _innermost(error: BaseException) -> tuple[Path, int, str] | None:
    """``(file, line, function)`` of the frame that raised ``error``."""
    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve(), tb.tb_lineno, tb.tb_frame.f_code.co_name


def _raised_at(error: BaseException) -> str:
    """The innermost frame as a person reads it: the path from the package on, line and function."""
    frame = _innermost(error)
    if frame is None:
        return ""
    path, line, function = frame
    parts = path.parts
    package = next((i for i in range(len(parts) - 1, -1, -1) if parts[i] in ("site-packages", "dist-packages")),
                   None)
    if package is not None:
        shown = "/".join(parts[package + 1:])
    elif path.is_relative_to(_PACKAGE):  # pipecheck itself, installed editable: pipecheck/_runners/.../rank.py
        shown = "/".join(path.relative_to(_PACKAGE.parent).parts)
    else:
        shown = "/".join(parts[-2:])
    return f"{shown}:{line} in {function}"


def _of_an_engine(name: str | None) -> bool:
    return bool(name) and str(name).split(".")[0] in _ENGINE_PACKAGES


def raised_in_pipecheck(error: BaseException) -> bool:
    """Whether ``error`` says an API of torch or an engine that pipecheck's adapter calls is missing or
    changed: raised in an adapter's own line (a keyword a release no longer takes fails at the caller's
    line; torch's or a model's own errors are raised in theirs) and, for an attribute or a module, one
    of torch's or an engine's (a user's object that lacks one, or a job the ranks cannot import, is not)."""
    frame = _innermost(error)
    if frame is None or frame[0] not in _ADAPTERS or isinstance(error, PipecheckError):
        return False
    if isinstance(error, AttributeError):
        owner = getattr(error, "obj", None)
        return _of_an_engine(owner.__name__ if isinstance(owner, types.ModuleType) else type(owner).__module__)
    if isinstance(error, ImportError):
        return _of_an_engine(error.name)
    return isinstance(error, TypeError)


def first_line(text: object) -> str:
    """The first non-blank line of ``str(text)``, stripped ("" if there is none): a message's headline."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def plural(count: int, noun: str) -> str:
    """``"1 stage"``, ``"4 stages"``, ``"2 micro-batches"``: a count and its noun, in messages."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def _type_name(error: BaseException) -> str:
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


class PipecheckError(Exception):
    """Base class of every error pipecheck raises on purpose."""


class SplitError(PipecheckError):
    """The model could not be cut into stages as asked (bad split_spec, policy, or cut)."""


class TraceError(SplitError):
    """The model could not be traced by the chosen tracer."""


class InputError(PipecheckError):
    """Inputs, kwargs, targets or micro-batch settings do not fit the model."""


class UsageError(InputError):
    """The command line was used wrongly: a bad option, path, module or value (exit status 2)."""


class RecordingError(PipecheckError):
    """An engine recorded boundary values (:class:`pipecheck.StageRecorder`) that do not fit pipecheck's
    split: too many or too few values for a stage, a shape the split's value does not have, a
    micro-batch out of range. The message lists the stage's values by position, name and shape."""


class LossError(PipecheckError):
    """The loss function raised, or returned something that is not a scalar tensor."""


class ScheduleError(PipecheckError):
    """A pipeline schedule is malformed or would deadlock."""


class WorldError(PipecheckError):
    """A worker process of a :class:`pipecheck.World` failed, hung or died."""


class _FailureInAnEngine(PipecheckError):
    """A failure while an engine ran: ``engine`` names the engine, ``rank`` and ``stage`` say where it
    failed when known, and ``cause`` is the failing rank's :class:`RankError`."""

    def __init__(self, message: str, *, engine: str | None = None, rank: int | None = None,
                 stage: int | None = None, cause: RankError | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.rank = rank
        self.stage = stage
        self.cause = cause


class EngineError(_FailureInAnEngine):
    """The pipeline engine under test failed to run the job (not a numerical mismatch).

    ``engine`` names the engine, ``rank`` and ``stage`` say where it failed when
    known, and ``cause`` is the failing rank's :class:`RankError`.
    """


class AdapterError(_FailureInAnEngine):
    """pipecheck's own adapter to an engine failed: an API of torch (or of the engine) that it calls is
    missing or changed on the installed version. pipecheck's problem, not a finding about the engine
    (not an :class:`EngineError`).

    ``engine``, ``rank``, ``stage`` and ``cause`` as on :class:`EngineError`.
    """


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


class PowerError(PipecheckError):
    """The check matched but cannot see a gross error on some tensors, so it certifies nothing.

    Under tolerance "auto", a tensor whose float32 eager run is itself far from the float64 truth
    gets a tolerance wide enough to hide a gradient 10% off (``row.blind``). ``str(err)`` names those
    tensors and the ways out; ``err.report`` is the full :class:`pipecheck.Report`.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class WorldStartError(WorldError):
    """The worker processes of a :class:`pipecheck.World` could not be started."""


class TaskPickleError(WorldError):
    """A task (its function, arguments or keyword arguments) cannot be sent to the ranks."""


class RankFailedError(WorldError):
    """A rank raised while running a task; ``error`` is what it raised, as a :class:`RankError`."""

    def __init__(self, message: str, error: RankError) -> None:
        super().__init__(message)
        self.error = error

    @property
    def rank(self) -> int:
        return self.error.rank

    @property
    def stage(self) -> int | None:
        return self.error.stage

    @property
    def traceback(self) -> str:
        return self.error.traceback


class RankTimeoutError(WorldError):
    """Some ranks did not finish a task in time; ``stacks`` maps every rank to its Python stack;
    ``hung`` is the rank the others wait for (None: not one rank stands out)."""

    def __init__(
        self,
        message: str,
        ranks: tuple[int, ...] = (),
        stacks: dict[int, str] | None = None,
        timeout: float = 0.0,
        *,
        hung: int | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.stacks = dict(stacks or {})
        self.timeout = timeout
        self.hung = hung


class RankDiedError(WorldError):
    """A rank's process exited during a task (os._exit, a signal, a crash)."""

    def __init__(
        self, message: str, rank: int = -1, exitcode: int | None = None, stage: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.stage = stage
