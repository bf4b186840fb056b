"""The rank side of :class:`pipecheck.World`: messages, the rank context, the worker loop.

    ctx = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    ctx.stage = 2          # error reports now say "stage 2"
    ctx.action = "2F0"

A *task* is one ``World.run(fn, ...)``: ``fn(ctx, ...)`` called once on every rank.
The driver (``_world.py``) and each worker talk only in the dataclasses below, each
pickled with plain :mod:`pickle` and sent with ``Connection.send_bytes``. Plain
pickle (not multiprocessing's ForkingPickler) copies tensors by value instead of
handing out shared-memory or CUDA-IPC handles that die with the sender.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing.process
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pipecheck._core.torch_versions import at_least
from pipecheck._world.handshake import foreign_connections, prove_peers
from pipecheck.errors import RankError

ACTION_BYTES = 64  # room for one action label per rank on the stage board
_NO_STAGE = -1
_PARENT_POLL_S = 0.5
HANDSHAKE_S = 15.0  # at most, how long a rank waits for its peers' proof that they are its peers
# The driver enforces every task's timeout itself, with stacks; the process
# group's own timeout only has to be longer than any sensible task.
PROCESS_GROUP_TIMEOUT = timedelta(days=1)
# torch 2.10's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks
# is : 1" on stdout as each rank joins a group (not 2.11 to 2.15: the string is not in their libtorch_cpu).
_GLOO_PRINTS_CONNECTIONS = not at_least(torch.__version__, "2.11")


@contextmanager
def gloo_connections_unprinted() -> Iterator[None]:
    """Make a process group without gloo's connection line on stdout. Every rank of a World prints it, a few
    bytes at a time, into the stdout the ranks share with their driver: garbled lines among the user's own,
    at every World start and restart. fd 1 points at /dev/null for the call alone."""
    if not _GLOO_PRINTS_CONNECTIONS:
        yield
        return
    if sys.stdout is not None:
        sys.stdout.flush()  # what Python holds goes where it was meant to
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        _flush_c_stdio()  # gloo's text still in C's buffer goes to /dev/null, not to the user
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library by that name here: its buffer is flushed at exit
        pass


# --- messages: driver -> worker ---------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a rank needs to join its world; pickled once at spawn."""

    rank: int
    world_size: int
    device: str
    comm_device: str
    backend: str
    store_path: str
    stack_path: str
    driver_pid: int  # the World's process: the rank exits when it is gone
    kill_with_parent: bool  # PR_SET_PDEATHSIG; only safe when the starting thread lives as long as the process
    threads: int  # intra-op threads of this rank (torch.set_num_threads)
    environ: dict[str, str]  # the driver's environment when the rank started (a forkserver has an older one)
    secret: bytes = b""  # the World's key: what a rank unpickles from a peer must carry its tag
    devices: tuple[str, ...] = ()  # every rank's compute device (WorldProperties.devices)
    start_deadline: float = float("inf")  # time.time() by which the driver gives up on the start


@dataclass(frozen=True)
class TaskCall:
    """The user's call, pickled separately so a rank can report a failure to unpickle it."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class TaskRequest:
    task_id: int
    call: bytes  # pickled TaskCall


@dataclass(frozen=True)
class Shutdown:
    pass


# --- messages: worker -> driver ---------------------------------------------


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    rank: int
    traceback: str


@dataclass(frozen=True)
class PeersUnproven:
    """The rank's connections did not all answer with the World's key (see handshake.py)."""

    rank: int
    problems: tuple[str, ...]  # one line per peer
    foreign: tuple[tuple[str, str], ...]  # (address, holder) of connections held outside the World


@dataclass(frozen=True)
class TaskDone:
    task_id: int
    rank: int
    value: bytes  # pickled return value of fn


@dataclass(frozen=True)
class TaskFailed:
    task_id: int
    error: RankError


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message))


def receive(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


@dataclass(frozen=True)
class WorldProperties:
    """How a World's ranks are placed: per-rank compute and communication devices."""

    world_size: int
    device: str  # what the user asked for: "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    devices: tuple[str, ...]  # rank r computes on devices[r]
    comm_devices: tuple[str, ...]  # rank r passes tensors to torch.distributed on comm_devices[r]
    gpus_shared: bool  # fewer GPUs than ranks: ranks share GPUs, talk through gloo, pass tensors by CUDA IPC
    launcher: str  # "spawn" (World(n)) or "torchrun" (World.from_env())
    threads_per_rank: int  # intra-op threads each rank runs (torch.set_num_threads)


# --- the stage board: what each rank is doing, readable after it hangs or dies


class StageBoard:
    """Shared memory holding each rank's current ``stage`` and ``action``.

    A rank that hangs or dies cannot answer questions; the driver reads the
    board instead, so even those errors can name the stage.
    """

    def __init__(self, world_size: int, mp_context: Any) -> None:
        self._stages = mp_context.RawArray(ctypes.c_int, [_NO_STAGE] * world_size)
        self._actions = mp_context.RawArray(ctypes.c_char, ACTION_BYTES * world_size)

    def publish(self, rank: int, stage: int | None, action: str | None) -> None:
        self._stages[rank] = _NO_STAGE if stage is None else int(stage)
        label = (action or "").encode()[: ACTION_BYTES - 1]
        start = rank * ACTION_BYTES
        self._actions[start : start + ACTION_BYTES] = label.ljust(ACTION_BYTES, b"\0")

    def read(self, rank: int) -> tuple[int | None, str | None]:
        stage = self._stages[rank]
        start = rank * ACTION_BYTES
        label = bytes(self._actions[start : start + ACTION_BYTES]).split(b"\0", 1)[0]
        return (None if stage == _NO_STAGE else stage), (label.decode(errors="replace") or None)


@dataclass
class RankContext:
    """What a task's ``fn(ctx, ...)`` knows about the rank it runs on.

    ``device`` is where the rank computes; ``comm_device`` is where tensors
    must be for ``torch.distributed`` calls (CPU when ranks share a GPU and
    talk through gloo); ``devices`` is every rank's compute device, by rank,
    ``""`` for a rank on another host: ranks on one GPU pass boundary tensors
    on it (``pipecheck._runtime.ipc``). Set ``stage`` and ``action`` as the task progresses so
    that a failure, hang or crash report says what the rank was doing; they are
    mirrored to ``board`` (internal), which the driver can read even after the
    rank hangs or dies.
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None
    threads: int = 1  # intra-op threads this rank runs, set once when it joins
    stage: int | None = None
    action: str | None = None
    board: StageBoard | None = field(default=None, repr=False, compare=False)
    secret: bytes = field(default=b"", repr=False, compare=False)  # the World's message key (see _comm)
    devices: tuple[str, ...] = ()  # every rank's compute device as this host names it; "" on another host

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        board = getattr(self, "board", None)
        if name in ("stage", "action") and board is not None:
            board.publish(self.rank, self.stage, self.action)


# --- the worker process -----------------------------------------------------


def any_rank(ctx: RankContext, this_rank: bool) -> bool:
    """Whether ``this_rank`` holds on any rank (an all-reduce every rank must call): how ranks agree
    to stop together, before an engine communicates, when one of them failed to prepare."""
    flag = torch.tensor([1.0 if this_rank else 0.0], device=ctx.comm_device)
    dist.all_reduce(flag, group=ctx.group)
    return bool(flag.item() > 0)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: no such process, or a zombie its parent has not reaped yet
    (a SIGKILLed driver whose own parent is busy is one; ``kill(pid, 0)`` still finds it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OverflowError, ValueError):
        return True  # no process has such a pid
    except OSError:
        pass  # alive, and not ours to signal
    try:
        with open(f"/proc/{pid}/stat", "rb") as status:  # "pid (comm) S ...": the state follows the last ')'
            return status.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False  # no /proc (not Linux): kill's answer stands


def _orphaned(parent_pid: int, driver_pid: int) -> bool:
    """The process that started this rank (the driver, or its forkserver) or the driver is gone."""
    return os.getppid() != parent_pid or process_gone(driver_pid)


def _exit_when_orphaned(parent_pid: int, driver_pid: int) -> None:
    # Runs in a daemon thread: a worker must never outlive its driver, even
    # while its main thread is stuck in a task or a collective.
    while True:
        if _orphaned(parent_pid, driver_pid):
            os._exit(1)
        time.sleep(_PARENT_POLL_S)


def _tie_lifetime_to_parent(config: WorkerConfig) -> None:
    parent_pid = os.getppid()  # the driver (spawn) or the driver's forkserver
    if config.kill_with_parent and sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog thread below still covers it
    if _orphaned(parent_pid, config.driver_pid):
        os._exit(1)  # the driver died before we could arm the checks
    watchdog = threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid, config.driver_pid), name="pipecheck-parent-watch"
    )
    watchdog.daemon = True
    watchdog.start()


def _thread_lock_for_tqdm() -> None:
    """torch.fx's Interpreter makes a (disabled) tqdm bar, and tqdm's first bar creates a
    multiprocessing lock: a semaphore the resource tracker then reports as leaked once a faulted
    rank is killed. A rank writes no shared progress bars; a thread lock is all it needs."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _handshake_timeout(config: WorkerConfig) -> float:
    """Every rank leaves init_process_group within moments of the others; a peer that has not
    answered in HANDSHAKE_S never will. Capped by the start's own deadline, so that the driver
    hears the rank's report before it gives up on the start."""
    return max(1.0, min(HANDSHAKE_S, config.start_deadline - time.time() - 1.0))


def _join_world(config: WorkerConfig, board: StageBoard) -> RankContext | PeersUnproven:
    if sys.platform.startswith("linux"):
        # Every rank lives on this host: loopback always works, whatever the
        # hostname resolves to. A value the user set wins.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(config.threads)
    _thread_lock_for_tqdm()
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(config.store_path, config.world_size)
    with gloo_connections_unprinted():
        dist.init_process_group(
            config.backend,
            store=store,
            rank=config.rank,
            world_size=config.world_size,
            timeout=PROCESS_GROUP_TIMEOUT,
        )
    if config.backend == "gloo" and config.world_size > 1:
        problems = prove_peers(config.rank, config.world_size, config.secret, _handshake_timeout(config))
        if problems:
            return PeersUnproven(config.rank, problems, foreign_connections())
    return RankContext(
        rank=config.rank,
        world_size=config.world_size,
        device=device,
        backend=config.backend,
        comm_device=torch.device(config.comm_device),
        group=dist.group.WORLD,
        threads=config.threads,
        board=board,
        secret=config.secret,
        devices=config.devices,
    )


def _unpickle_hint(error: BaseException) -> str:
    return (
        f"\nThe task could not be unpickled on this rank ({type(error).__name__}: {error}). "
        "fn must be a top-level function of a module the workers can import: not a lambda, "
        "a nested function, or a function defined in an interactive session or `python -c`."
    )


def run_call(ctx: RankContext, task_id: int, call: TaskCall | bytes) -> TaskDone | TaskFailed:
    """Run one task on this rank; never raises. ``call`` may still be pickled."""
    ctx.stage = None
    ctx.action = None
    hint = ""
    try:
        if isinstance(call, bytes):
            try:
                call = pickle.loads(call)
            except Exception as error:
                hint = _unpickle_hint(error)
                raise
        assert isinstance(call, TaskCall)  # the driver only ever sends a TaskCall
        value = call.fn(ctx, *call.args, **call.kwargs)
        try:
            return TaskDone(task_id, ctx.rank, pickle.dumps(value))
        except Exception:
            hint = (
                f"\nfn returned a {type(value).__name__}, which cannot be pickled back to the "
                "driver; return plain data or CPU tensors."
            )
            raise
    except BaseException as error:  # SystemExit from a task is a failure too
        # Drop this function's own frame: the traceback starts in the user's fn.
        tb = error.__traceback__
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        text = "".join(traceback.format_exception(type(error), error, tb)) + hint
        return TaskFailed(task_id, RankError.from_exception(error, ctx.rank, ctx.stage, ctx.action, text))


def worker_main(config: WorkerConfig, conn: Connection, board: StageBoard) -> None:
    """Entry point of a spawned rank: join the world, then run tasks until told to stop."""
    # Ctrl-C reaches the whole process group; only the driver should react.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()  # as if spawned now: a forkserver started with the environment of an earlier moment
    os.environ.update(config.environ)
    _tie_lifetime_to_parent(config)
    # What multiprocessing writes from this rank goes to the World's folder, which the driver removes
    # (or the next World's sweep, if the driver was killed): never a pymp-* folder of its own in TMPDIR.
    multiprocessing.process.current_process()._config["tempdir"] = os.path.dirname(config.stack_path)  # type: ignore[attr-defined]
    stack_file = open(config.stack_path, "a")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=stack_file, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        ctx = _join_world(config, board)
    except BaseException:
        send(conn, StartFailed(config.rank, traceback.format_exc()))
        return
    if isinstance(ctx, PeersUnproven):
        send(conn, ctx)
        return  # the driver stops every rank: none may run a task over a connection it cannot trust
    send(conn, Ready(config.rank, os.getpid()))
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            os._exit(0)  # the driver is gone; nothing to clean up for
        match message:
            case TaskRequest():
                send(conn, run_call(ctx, message.task_id, message.call))
            case Shutdown():
                break
    ctx.group = None  # see _TorchrunRank.stop in _world.py: no group may outlive the process group
    dist.destroy_process_group()
