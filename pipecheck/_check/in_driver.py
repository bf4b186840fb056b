"""A user's runner runs in this process: the check's ``timeout`` stops it as a World's stops its ranks.

    run = in_driver(run, "my_runner", timeout=30)   # the runner itself where timeout is None
    result = run(job)    # EngineError after 30 s, naming the runner and the line it was stuck at

The runner runs in a daemon thread that the check waits on. At the timeout the check raises an
:class:`EngineError` whose cause is a ``TimeoutError``, with the runner's Python stack at that moment
(``sys._current_frames``). A Python thread cannot be killed: the runner's thread is asked to stop (an
exception raised in it, which it sees as soon as it runs Python again), and one blocked in native code
(a sleep, a lock, a socket) is left behind as a daemon thread, which never keeps the process from
exiting. A runner's ``train`` is bounded by ``timeout`` per schedule step; every other attribute
(``check_split``, ``follows_precision``, ...) is the runner's own.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from pipecheck._runners.job import Job
from pipecheck.errors import EngineError


def in_driver(run: Any, runner_name: str, timeout: float | None) -> Any:
    """``run`` bounded by ``timeout`` seconds a step (unchanged where ``timeout`` is None)."""
    return run if timeout is None else _Bounded(run, runner_name, timeout)


class _Bounded:
    """A runner whose calls (``__call__``, ``train``) end with an EngineError after the check's timeout."""

    def __init__(self, run: Any, runner_name: str, timeout: float) -> None:
        self._run, self._name, self._timeout = run, runner_name, timeout

    def __call__(self, job: Job) -> Any:
        return call_in_time(self._run, job, self._name, self._timeout, "run the job")

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._run, name)
        if name == "train" and callable(value):
            return lambda job: call_in_time(value, job, self._name, self._timeout * job.training.schedule_steps,
                                            "train")
        return value


class _Abandoned(BaseException):
    """Raised in a runner's thread once the check has stopped waiting for it: ends it where Python can."""


def call_in_time(call: Callable[[Job], Any], job: Job, runner_name: str, timeout: float, doing: str) -> Any:
    """``call(job)`` in a daemon thread, waited on for ``timeout`` seconds; what it raises, raised here."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call(job)
        except _Abandoned:
            pass  # nobody waits for it any more
        except BaseException as err:  # handed to the waiting check, which raises it
            outcome["error"] = err

    thread = threading.Thread(target=target, name=f"pipecheck runner {runner_name!r}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        stack = _stack_of(thread)
        _stop(thread)
        raise EngineError(
            f"runner {runner_name!r} did not finish within timeout={timeout} s: it was asked to {doing} in this "
            f"process and was stuck at (most recent call last):\n{stack}\n"
            "pipecheck stopped waiting for it. A Python thread cannot be killed: the runner's thread was told to "
            "stop, which ends it as soon as it runs Python again; one blocked in native code (a sleep, a lock, a "
            "socket, a collective) stays behind as a daemon thread, which does not keep the process from exiting. "
            "Fix: make the runner return, or raise, where it is stuck above (a receive or collective whose peer "
            "never comes, a lock never released, a process it waits for); if it is only slow, pass a larger "
            "timeout=.", engine=runner_name) from TimeoutError(f"runner {runner_name!r}: {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _stack_of(thread: threading.Thread) -> str:
    """The runner's own frames in ``thread`` (most recent call last), without the thread's start-up."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "    (its stack could not be read)"
    frames = traceback.extract_stack(frame)
    starts = [i for i, summary in enumerate(frames) if summary.filename == __file__ and summary.name == "target"]
    lines = "".join(traceback.format_list(frames[starts[-1] + 1:] if starts else frames)).rstrip().splitlines()
    return "\n".join("  " + line for line in lines)


def _stop(thread: threading.Thread) -> None:
    """Raise ``_Abandoned`` in ``thread`` the next time it runs Python (CPython's own mechanism)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
