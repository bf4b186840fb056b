"""A pool of ranks with torch.distributed initialised once, running tasks on every rank.

    with World(2) as world:                        # spawns rank 0 and rank 1 (gloo on CPU)
        sums = world.run(all_reduce_rank, timeout=30)   # all_reduce_rank(ctx) on each rank
    # sums[r] is what rank r returned

    world = World.shared(4)                        # one World per (size, device) for the process

``fn`` must be a top-level function of an importable module; it is called as
``fn(ctx, *args, **kwargs)`` with a :class:`RankContext`. A rank that raises,
hangs past the timeout or dies becomes a :class:`RankFailedError`,
:class:`RankTimeoutError` or :class:`RankDiedError` naming the rank, its stage
and its traceback or stack; the processes are then stopped and the next
``run()`` starts fresh ones. Under ``torchrun``, ``World.from_env()`` makes this
process one rank of the launched world, and the same task code runs unchanged.

Workers are spawned (never forked: torch is not fork-safe), rendezvous through
a ``FileStore`` in a private temporary directory (so any number of worlds, e.g.
one per pytest-xdist worker, never collide), prove to each other with the World's
key that every connection reaches its true peer (``handshake.py``: a process that
took a peer's place on a rank's port is refused and named at start) and die with
their driver.

Every rank runs ``threads_per_rank`` intra-op threads (default: the machine's
cores shared among the ranks), set once when it joins; results are bitwise
reproducible at equal thread counts.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing.util  # noqa: F401 - import before atexit.register below, see _close_live_worlds
import os
import pickle
import signal
import socket
import threading
import weakref
from typing import Any, cast

import torch
import torch.distributed as dist

from pipecheck._world.faults import Fault, fault_error
from pipecheck._world.spawn import SpawnedRanks
from pipecheck._world.tempdirs import remove_multiprocessing_tempdir
from pipecheck._world.worker import (
    RankContext,
    TaskCall,
    TaskFailed,
    WorldProperties,
    gloo_connections_unprinted,
    run_call,
)
from pipecheck.errors import TaskPickleError, WorldError

__all__ = ["RankContext", "World", "WorldProperties"]


def _no_cuda_error() -> WorldError:
    return WorldError(
        f"World(device='cuda') needs CUDA, but torch.cuda.is_available() is False "
        f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). "
        "Use World(..., device='cpu') to run the ranks on CPU with gloo."
    )


def default_threads_per_rank(world_size: int) -> int:
    """The machine's cores shared among the ranks (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _plan(world_size: int, device: str, threads: int, launcher: str = "spawn") -> WorldProperties:
    ranks = range(world_size)
    if device == "cpu":
        cpus = ("cpu",) * world_size
        return WorldProperties(world_size, device, "gloo", cpus, cpus, False, launcher, threads)
    if not torch.cuda.is_available():
        raise _no_cuda_error()
    count = torch.cuda.device_count()
    devices = tuple(f"cuda:{rank % count}" for rank in ranks)
    if count >= world_size:
        return WorldProperties(world_size, device, "nccl", devices, devices, False, launcher, threads)
    return WorldProperties(world_size, device, "gloo", devices, ("cpu",) * world_size, True, launcher, threads)


def _check_arguments(world_size: object, device: object, threads_per_rank: object = None,
                     **timeouts: object) -> None:
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size must be an int >= 1 (got {world_size!r})")
    if device not in ("cpu", "cuda"):
        problems.append(f"device must be 'cpu' or 'cuda' (got {device!r})")
    if threads_per_rank is not None and (isinstance(threads_per_rank, bool)
                                         or not isinstance(threads_per_rank, int) or threads_per_rank < 1):
        problems.append(f"threads_per_rank must be an int >= 1 or None (got {threads_per_rank!r})")
    for name, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            problems.append(f"{name} must be a number of seconds > 0 (got {value!r})")
    if problems:
        raise WorldError("World: " + "; ".join(problems) + ".")


def _task_name(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _pickle_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps(TaskCall(fn, args, dict(kwargs)))
    except Exception as whole:
        parts = [("fn", fn), *((f"args[{i}]", a) for i, a in enumerate(args)),
                 *((f"kwargs[{k!r}]", v) for k, v in kwargs.items())]
        what, error = "the task", whole
        for part, value in parts:
            problem = pickle_problem(value)
            if problem is not None:
                what, error = part, problem
                break
        raise TaskPickleError(
            f"World.run(): {what} cannot be pickled to send it to the ranks "
            f"({type(error).__name__}: {error}). fn must be a top-level function of an "
            "importable module (not a lambda, a nested function or a bound method of an "
            "unpicklable object), and args/kwargs must be picklable: move fn to module "
            "level, or pass data instead of live objects."
        ) from error


def pickle_problem(value: Any) -> Exception | None:
    """What ``pickle.dumps(value)`` raises, or None if it pickles."""
    try:
        pickle.dumps(value)
    except Exception as error:
        return error
    return None


class _TorchrunRank:
    """This process is one rank of a world launched by torchrun (env:// rendezvous)."""

    def __init__(self, device: str | None, threads: int | None) -> None:
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise WorldError(
                f"World.from_env() needs the environment torchrun sets up; missing {', '.join(missing)}. "
                "Launch with `torchrun --nproc-per-node N script.py`, or use World(N) to spawn local ranks."
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_arguments(world_size, device, threads)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = threads or max(1, (os.cpu_count() or 1) // local_ranks)
        torch.set_num_threads(threads)
        if device == "cuda":
            if not torch.cuda.is_available():
                raise _no_cuda_error()
            count = torch.cuda.device_count()
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % count)
            torch.cuda.set_device(local)
            # NCCL needs one GPU per rank; ranks sharing a GPU talk through gloo.
            shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > count
            backend = "gloo" if shared else "nccl"
        else:
            local, backend, shared = torch.device("cpu"), "gloo", False
        self.owns_group = not dist.is_initialized()
        with gloo_connections_unprinted():
            if self.owns_group:
                dist.init_process_group(backend, init_method="env://")
            backend = str(dist.get_backend())  # whatever the user initialised, if they did
            # Results travel through a gloo group so gathering them never touches a GPU.
            self.control: dist.ProcessGroup | None = cast(  # new_group's type allows a non-member's
                dist.ProcessGroup, dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
            )  # sentinel too; every rank is a member
        comm = local if backend == "nccl" else torch.device("cpu")
        placements: list[Any] = [None] * world_size
        host = socket.gethostname()
        dist.all_gather_object(placements, (str(local), str(comm), host), group=self.control)
        # Ranks on this host and GPU pass tensors by CUDA IPC (pipecheck._runtime.ipc): another host's
        # "cuda:0" is another GPU.
        here = tuple(compute if on == host else "" for compute, _, on in placements)
        self.ctx = RankContext(rank, world_size, local, backend, comm, dist.group.WORLD, threads, devices=here)
        self.properties = WorldProperties(
            world_size,
            device,
            backend,
            tuple(compute for compute, _, _ in placements),
            tuple(talk for _, talk, _ in placements),
            shared,
            "torchrun",
            threads,
        )

    def run(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], task: str, timeout: float
    ) -> list[bytes]:
        # A hang here cannot be interrupted from inside; at least every rank prints its stacks.
        faulthandler.dump_traceback_later(timeout, exit=False)
        try:
            outcome = run_call(self.ctx, 0, TaskCall(fn, args, kwargs))
            gathered: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, outcome, group=self.control)
        finally:
            faulthandler.cancel_dump_traceback_later()
        faults = [
            Fault(o.error.rank, o.error.stage, o.error.action, error=o.error)
            for o in gathered if isinstance(o, TaskFailed)
        ]
        if faults:
            note = "Every rank raises this error; the process group stays up."
            raise fault_error(faults, set(), task, self.ctx.world_size, note)
        return [o.value for o in gathered]

    def stop(self) -> None:
        # Drop our references to the groups first: a group object that outlives
        # destroy_process_group() is torn down at interpreter exit, where gloo
        # aborts ("terminate called without an active exception").
        self.ctx.group = self.control = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


_LIVE_WORLDS: weakref.WeakSet[World] = weakref.WeakSet()
_SHARED: dict[tuple[int, str], World] = {}  # World.shared's pool


class World:
    """A persistent set of ranks; ``run(fn, ...)`` calls ``fn(ctx, ...)`` on every rank.

    ``timeout`` is the default per task, ``start_timeout`` bounds starting the
    ranks, ``threads_per_rank`` is each rank's intra-op thread count (None: the
    cores shared among the ranks). Processes start on ``__enter__`` or on the
    first ``run()``.
    """

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        timeout: float = 120.0,
        start_timeout: float = 120.0,
        threads_per_rank: int | None = None,
    ) -> None:
        _check_arguments(world_size, device, threads_per_rank, timeout=timeout, start_timeout=start_timeout)
        properties = _plan(world_size, device, threads_per_rank or default_threads_per_rank(world_size))
        self._setup(properties, SpawnedRanks(properties, start_timeout), timeout)
        self._start_timeout = start_timeout
        _clean_up_on_sigterm()

    def _setup(
        self, properties: WorldProperties, ranks: SpawnedRanks | _TorchrunRank, timeout: float
    ) -> None:
        self.properties = properties
        self.timeout = timeout
        self._ranks = ranks
        self._lock = threading.Lock()
        self._closed = False
        _LIVE_WORLDS.add(self)

    @classmethod
    def from_env(cls, device: str | None = None, *, timeout: float = 120.0,
                 threads_per_rank: int | None = None) -> World:
        """This process as one rank of a torchrun-launched world.

        ``run()`` calls ``fn`` here only and gathers every rank's result, so
        each rank gets the full list. ``device`` defaults to CUDA when present.
        """
        _check_arguments(1, device or "cpu", threads_per_rank, timeout=timeout)
        world = cls.__new__(cls)
        ranks = _TorchrunRank(device, threads_per_rank)
        world._setup(ranks.properties, ranks, timeout)
        return world

    @classmethod
    def shared(cls, world_size: int, device: str = "cpu", *, timeout: float = 120.0) -> World:
        """A World of ``world_size`` ranks on ``device`` kept for the whole process, made on first use.

        Checks that pass no World run on these (one pool per pytest-xdist worker);
        :meth:`close_shared` stops them, and so does the interpreter's exit.
        """
        key = (world_size, str(device))
        world = _SHARED.get(key)
        if world is not None and not world.closed and world._lost_a_rank():
            world.close()  # killed while idle (its forkserver, the OOM killer): the pool's loss, not a check's
        if world is None or world.closed:
            world = cls(world_size, device=str(device), timeout=timeout)
            _SHARED[key] = world
        return world

    @staticmethod
    def close_shared() -> None:
        """Stop every World made by :meth:`shared`."""
        for world in list(_SHARED.values()):
            world.close()
        _SHARED.clear()

    @property
    def world_size(self) -> int:
        return self.properties.world_size

    @property
    def device(self) -> str:
        return self.properties.device

    @property
    def threads_per_rank(self) -> int:
        return self.properties.threads_per_rank

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: a closed World runs nothing more."""
        return self._closed

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the ranks (empty when not started; this process under torchrun)."""
        if isinstance(self._ranks, _TorchrunRank):
            return (os.getpid(),)
        return self._ranks.pids

    def folder(self) -> str | None:
        """A folder of this World's own that its driver and ranks both read (removed with it): where the
        driver puts a file every rank reads, rather than pickling it to each. The ranks start first if they
        have not. None under torchrun, whose ranks may be on other machines."""
        if isinstance(self._ranks, _TorchrunRank):
            return None
        self._ensure_open()
        with self._lock:
            if not self._ranks.started:
                self._ranks.start()
            return self._ranks.tmpdir

    def __repr__(self) -> str:
        if self.properties.launcher == "torchrun":
            return f"World.from_env(device={self.device!r}, timeout={self.timeout})"
        return f"World({self.world_size}, device={self.device!r}, timeout={self.timeout}, start_timeout={self._start_timeout})"

    def __enter__(self) -> World:
        self._ensure_open()
        if isinstance(self._ranks, SpawnedRanks) and not self._ranks.started:
            with self._lock:
                self._ranks.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _lost_a_rank(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False  # running a task in another thread: alive as far as anyone can tell now
        try:
            return isinstance(self._ranks, SpawnedRanks) and bool(self._ranks.dead_ranks())
        finally:
            self._lock.release()

    def _ensure_open(self) -> None:
        if self._closed:
            raise WorldError(f"{self!r} is closed; create a new World to run more tasks.")

    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(ctx, *args, **kwargs)`` on every rank; return each rank's value, index = rank."""
        self._ensure_open()
        timeout = self.timeout if timeout is None else timeout
        _check_arguments(1, "cpu", timeout=timeout)
        task = _task_name(fn)
        with self._lock:
            if isinstance(self._ranks, _TorchrunRank):
                values = self._ranks.run(fn, args, kwargs, task, timeout)
            else:
                values = self._ranks.run(_pickle_call(fn, args, kwargs), task, timeout)
        results = []
        for rank, value in enumerate(values):
            try:
                results.append(pickle.loads(value))
            except Exception as error:
                raise WorldError(
                    f"rank {rank}'s return value of task {task} cannot be unpickled in the driver "
                    f"({type(error).__name__}: {error}); return plain data or CPU tensors whose "
                    "classes the driver can import."
                ) from error
        return results

    def restart(self) -> None:
        """Stop every rank and start fresh ones (a new process group)."""
        self._ensure_open()
        if isinstance(self._ranks, _TorchrunRank):
            raise WorldError(
                "A torchrun world cannot restart its own processes; use torchrun --max-restarts."
            )
        with self._lock:
            self._ranks.stop(graceful=True)
            self._ranks.start()

    def close(self) -> None:
        """Stop every rank: leave the process group, then SIGTERM, then SIGKILL."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _LIVE_WORLDS.discard(self)
        if isinstance(self._ranks, _TorchrunRank):
            self._ranks.stop()
        else:
            self._ranks.stop(graceful=True)

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True) and isinstance(self._ranks, SpawnedRanks):
                self._closed = True
                self._ranks.stop(graceful=False)
        except Exception:
            pass  # interpreter shutdown; the workers' parent-death checks take over


def _close_live_worlds() -> None:
    # Registered after multiprocessing.util's own exit hook, so it runs first:
    # that hook joins live non-daemonic children and would wait forever.
    for world in list(_LIVE_WORLDS):
        world.close()


atexit.register(_close_live_worlds)


def _clean_up_on_sigterm() -> None:
    """Make SIGTERM to the driver clean up as Ctrl-C does: ranks stopped, temp folders (the World's,
    multiprocessing's) removed.

    Python's default SIGTERM ends the process without exit hooks; the ranks then notice their
    driver is gone, but the World's folder stays. Installed only from the main thread and only over
    the default disposition: a handler of the user's own is never replaced.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for world in list(_LIVE_WORLDS):
        if isinstance(world._ranks, SpawnedRanks):
            world._closed = True
            world._ranks.stop(graceful=False)
    remove_multiprocessing_tempdir()  # no exit hook removes it: the process dies of the signal
    os.kill(os.getpid(), signal.SIGTERM)  # and die of it, as the sender expects (exit status -15)
