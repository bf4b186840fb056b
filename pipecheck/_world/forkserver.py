"""How ranks start: from multiprocessing's forkserver, which imports torch once, or spawned afresh.

    spawn = process_context()                 # a ForkServerContext on Linux, else a SpawnContext
    own_forkserver_if_started(was_running)    # pipecheck stops the forkserver it started, at exit
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import sys
from typing import Any

from pipecheck.errors import WorldError

# What the forkserver imports once, so that no rank it starts pays for it again (after a fault, a World
# starts fresh ranks): torch; torch's pipelining (1.7 s a rank); what a first torch.export trace imports
# (0.5 s a rank: dynamo, export, aot_autograd; torch's pipeline() and tracer='export' trace with it).
# Imports only: no thread starts, no device is touched. One that fails is skipped by multiprocessing.
PRELOADED = ["pipecheck._world.worker", "torch.distributed.pipelining", "torch._dynamo", "torch.export._trace",
             "torch._functorch.aot_autograd"]


def process_context() -> Any:  # a SpawnContext or ForkServerContext
    """How ranks start: from a forkserver that imported torch once (a rank then starts in a fraction
    of a second, and a World restarts after a fault as fast), or spawned afresh.

    forkserver on Linux unless ``PIPECHECK_START_METHOD=spawn``; spawn elsewhere. Never fork: the
    driver may hold threads, CUDA or gloo state that a forked child must not inherit.
    """
    method = os.environ.get("PIPECHECK_START_METHOD") or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    if method not in ("forkserver", "spawn"):
        raise WorldError(f"PIPECHECK_START_METHOD={method!r} is not 'forkserver' or 'spawn'. Fix: unset it, "
                         "or pick one of those.")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(PRELOADED)
    return context


def _forkserver() -> Any:
    return multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]


def own_forkserver_if_started(was_running: bool) -> None:
    """Stop multiprocessing's forkserver at exit if pipecheck's ranks are what started it (``was_running``:
    whether one ran before they started). The stop runs after multiprocessing has stopped and joined
    the process's other children, which a user's own code may have started from the same forkserver."""
    global _forkserver_owned
    if was_running or _forkserver_owned or getattr(_forkserver(), "_forkserver_pid", None) is None:
        return
    _forkserver_owned = True
    multiprocessing.util.Finalize(None, stop_forkserver, exitpriority=-100)


_forkserver_owned = False


def stop_forkserver() -> None:
    """Stop multiprocessing's forkserver now and reap it. Left alone it outlives the driver by the 1.6 s
    it takes to tear torch down once it notices the driver has gone (measured); it holds nothing that
    needs that teardown (it imports and forks), so it is killed."""
    server = _forkserver()
    with getattr(server, "_lock", contextlib.nullcontext()):
        pid, alive = getattr(server, "_forkserver_pid", None), getattr(server, "_forkserver_alive_fd", None)
        if pid is None or alive is None:
            return
        server._forkserver_pid = server._forkserver_alive_fd = None
        with contextlib.suppress(OSError):
            os.close(alive)
        with contextlib.suppress(OSError):  # ProcessLookupError: gone already
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # reaped already (SIGCHLD ignored)
            os.waitpid(pid, 0)
        address = getattr(server, "_forkserver_address", None)
        if address and not multiprocessing.util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_address = None
