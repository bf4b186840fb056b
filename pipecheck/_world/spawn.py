"""The driver side of spawned ranks: start them, run a task, turn faults into reports.

    ranks = SpawnedRanks(properties, start_timeout=60)
    values = ranks.run(pickled_call, "mod.fn", timeout=30)  # one pickled return value per rank
    ranks.stop(graceful=True)

Used by :class:`pipecheck.World`; it knows nothing about pipelines. Every way a
task can go wrong ends the same way: the report is built while the ranks are
still there to ask (stage board, faulthandler stacks), then every rank is
stopped so the next task starts from fresh processes.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import secrets
import shutil
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from multiprocessing.process import BaseProcess
from typing import Any

from pipecheck._world.faults import (
    Fault,
    exit_status,
    fault_error,
    idle_death_error,
    indent,
    start_error,
    timeout_error,
    where,
)
from pipecheck._world.forkserver import _forkserver, own_forkserver_if_started, process_context
from pipecheck._world.tempdirs import (
    disk_problem,
    make_tmpdir,
    own_multiprocessing_tempdir,
    sweep_stale_tmpdirs,
)
from pipecheck._world.worker import (
    PeersUnproven,
    Ready,
    Shutdown,
    StageBoard,
    StartFailed,
    TaskDone,
    TaskFailed,
    TaskRequest,
    WorkerConfig,
    WorldProperties,
    process_gone,
    receive,
    send,
    worker_main,
)
from pipecheck.errors import (
    RankTimeoutError,
    WorldStartError,
)

FAULT_GRACE_S = 0.5  # after a first fault, how long to collect the other ranks' reports
STACK_WAIT_S = 3.0  # how long ranks get to write their stacks after SIGUSR1
SHUTDOWN_GRACE_S = 3.0  # close(): time to leave the process group before SIGTERM
KILL_GRACE_S = 1.0  # time between SIGTERM and SIGKILL
# A rank that is gone, but whose exit status its forkserver has not reported yet: a moment, longer on a busy
# machine. Only ever waited for once the rank has exited.
EXIT_STATUS_WAIT_S = 10.0
RESTART_NOTE = "The world's processes were stopped; the next run() starts fresh ones."
RANK_NAME = "pipecheck-rank"  # then the rank: the process name of a spawned rank
# A spawned rank that finds itself starting ranks while it imports the user's script (no main guard)
# exits with this status, silently; the driver then raises one message for all ranks.
UNGUARDED_MAIN_EXIT = 92
UNGUARDED_MAIN = (
    "this script starts pipecheck's worker processes at module level (a World, "
    "assert_equivalent(runner='distributed' or 'torch'), run_pipeline), outside a main guard. Each "
    "worker imports the script again (as multiprocessing's spawn and forkserver start methods do) and would start workers "
    "of its own, so no worker started.\n"
    "Fix: put the script's work under a main guard:\n"
    "    if __name__ == \"__main__\":\n"
    "        main()"
)


def in_spawned_import() -> bool:
    """True while a spawned child process imports the parent's main script (its bootstrapping phase)."""
    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def _exit_now(status: int) -> None:
    """Leave the process with ``status`` (a forkserver's child turns any SystemExit raised while it
    imports the main script into status 1: only os._exit keeps the status)."""
    sys.stderr.flush()
    os._exit(status)


def refuse_unguarded_main() -> None:
    """Stop a missing main guard before it starts ranks from inside a spawned child.

    Called wherever ranks would start. In one of pipecheck's own ranks the process exits
    quietly with :data:`UNGUARDED_MAIN_EXIT` and the driver reports it once; in any other
    spawned child it is a :class:`WorldStartError` saying what to fix.
    """
    if not in_spawned_import():
        _refuse_main_without_a_file()
        return
    if multiprocessing.current_process().name.startswith(RANK_NAME):
        _exit_now(UNGUARDED_MAIN_EXIT)
    raise WorldStartError(UNGUARDED_MAIN)


def _refuse_main_without_a_file() -> None:
    """Ranks import the main script again from its path; a script read from standard input
    (``python - < script.py``) has none, and every rank would die inside multiprocessing."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and isinstance(path, str) and not os.path.exists(path):
        raise WorldStartError(
            f"the main script is {path!r}, not a file (read from standard input?), and each of pipecheck's "
            "worker processes imports the main script again from its path. Fix: save the script to a file "
            "and run `python script.py`."
        )


def await_exit_status(proc: BaseProcess) -> None:
    """Give a rank whose pipe closed ``KILL_GRACE_S`` to exit, and once it has, up to ``EXIT_STATUS_WAIT_S``
    for its exit status (which its forkserver sends a moment after): an error names how the rank ended."""
    proc.join(KILL_GRACE_S)
    deadline = time.monotonic() + EXIT_STATUS_WAIT_S
    while proc.exitcode is None and process_gone(proc.pid or 0) and time.monotonic() < deadline:
        proc.join(0.05)


class SpawnedRanks:
    """The ranks as spawned child processes of this (driver) process."""

    def __init__(self, properties: WorldProperties, start_timeout: float) -> None:
        self.properties = properties
        self.start_timeout = start_timeout
        self.tmpdir: str | None = None
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.board: StageBoard | None = None
        self.task_ids = itertools.count()

    @property
    def started(self) -> bool:
        return bool(self.procs)

    def stack_path(self, rank: int) -> str:
        assert self.tmpdir is not None
        return os.path.join(self.tmpdir, f"rank{rank}.stack")

    def start(self) -> None:
        refuse_unguarded_main()
        spawn = process_context()
        forkserver_ran = getattr(_forkserver(), "_forkserver_pid", None) is not None
        n = self.properties.world_size
        if (full := disk_problem()) is not None:
            raise WorldStartError(f"Could not start {self._described()}: {full}")
        sweep_stale_tmpdirs()
        own_multiprocessing_tempdir()
        self.tmpdir = make_tmpdir()
        self.board = StageBoard(n, spawn)
        # PR_SET_PDEATHSIG fires when the *thread* that started the child exits: a forkserver's
        # only thread lives as long as the server; a spawning thread must be the main thread.
        in_main_thread = threading.current_thread() is threading.main_thread()
        kill_with_parent = in_main_thread or spawn.get_start_method() == "forkserver"
        secret = secrets.token_bytes(32)  # travels in the pickled config, never through the store or argv
        deadline, wall_deadline = time.monotonic() + self.start_timeout, time.time() + self.start_timeout
        try:
            for rank in range(n):
                config = WorkerConfig(
                    rank=rank,
                    world_size=n,
                    device=self.properties.devices[rank],
                    comm_device=self.properties.comm_devices[rank],
                    backend=self.properties.backend,
                    store_path=os.path.join(self.tmpdir, "filestore"),
                    stack_path=self.stack_path(rank),
                    driver_pid=os.getpid(),
                    kill_with_parent=kill_with_parent,
                    threads=self.properties.threads_per_rank,
                    environ=dict(os.environ),
                    secret=secret,
                    devices=self.properties.devices,
                    start_deadline=wall_deadline,
                )
                driver_end, worker_end = spawn.Pipe()
                proc = spawn.Process(
                    target=worker_main,
                    args=(config, worker_end, self.board),
                    name=f"{RANK_NAME}{rank}",
                )
                proc.start()
                own_forkserver_if_started(forkserver_ran)
                worker_end.close()
                self.procs.append(proc)
                self.conns.append(driver_end)
            self._await_ready(deadline)
        except BaseException:
            self.stop(graceful=False)
            raise

    def _described(self) -> str:
        props = self.properties
        return (f"World({props.world_size}, device={props.device!r}) "
                f"(backend {props.backend}, devices {', '.join(props.devices)})")

    def _await_ready(self, deadline: float) -> None:
        n = self.properties.world_size
        pending, problems, unproven, unguarded = set(range(n)), [], [], False
        while pending and not unguarded and time.monotonic() < deadline:
            waitables: dict[Any, int] = {self.conns[r]: r for r in pending} | {
                self.procs[r].sentinel: r for r in pending
            }
            for ready in wait_for(list(waitables), timeout=max(0.0, deadline - time.monotonic())):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                try:
                    message = receive(self.conns[rank])
                except (EOFError, OSError):
                    await_exit_status(self.procs[rank])
                    unguarded = unguarded or self.procs[rank].exitcode == UNGUARDED_MAIN_EXIT
                    problems.append(
                        f"rank {rank} {exit_status(self.procs[rank].exitcode)} before joining the "
                        "world; its stderr above says why (every rank imports the main script "
                        "again: code at its module level runs in each rank)."
                    )
                    continue
                if isinstance(message, StartFailed):
                    problems.append(
                        f"rank {rank} failed to join the world:\n{indent(message.traceback)}"
                    )
                elif isinstance(message, PeersUnproven):
                    unproven.append(message)
                elif not isinstance(message, Ready):
                    problems.append(f"rank {rank} sent {message!r} instead of Ready")
            if problems or unproven:  # the others' reports, if they come at once
                deadline = min(deadline, time.monotonic() + FAULT_GRACE_S)
        if unguarded:
            raise WorldStartError(UNGUARDED_MAIN)
        if pending and not problems and not unproven:
            stacks = self.dump_stacks(dict.fromkeys(pending, 0))
            problems.extend(
                f"rank {r} did not join within start_timeout={self.start_timeout} s; its stack:\n{indent(stacks[r])}"
                for r in sorted(pending)
            )
        if problems or unproven:
            raise start_error(self._described(), problems, unproven, disk_problem(self.tmpdir))

    def run(self, call: bytes, task: str, timeout: float) -> list[bytes]:
        if not self.started:
            self.start()
        if dead := self.dead_ranks():
            self.stop(graceful=False)
            raise idle_death_error(dead, task, self.properties.world_size, RESTART_NOTE)
        task_id = next(self.task_ids)
        offsets = {r: self._stack_size(r) for r in range(self.properties.world_size)}
        request = pickle.dumps(TaskRequest(task_id, call))
        try:
            for conn in self.conns:
                try:
                    conn.send_bytes(request)
                except OSError:
                    pass  # a dead rank; its sentinel reports it below
            done, faults, pending = self._collect(task_id, offsets, time.monotonic() + timeout)
            if faults:
                raise fault_error(faults, pending, task, self.properties.world_size, RESTART_NOTE)
            if pending:
                raise self._timeout_error(pending, offsets, task, timeout)
        except BaseException:
            self.stop(
                graceful=False
            )  # faults, timeouts and Ctrl-C leave the ranks in an unknown state
            raise
        return [done[r] for r in range(self.properties.world_size)]

    def _collect(
        self, task_id: int, offsets: dict[int, int], deadline: float
    ) -> tuple[dict[int, bytes], list[Fault], set[int]]:
        done: dict[int, bytes] = {}
        faults: list[Fault] = []
        pending = set(range(self.properties.world_size))
        while pending and (now := time.monotonic()) < deadline:
            waitables: dict[Any, int] = {self.conns[r]: r for r in pending} | {
                self.procs[r].sentinel: r for r in pending
            }
            for ready in wait_for(list(waitables), timeout=deadline - now):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                outcome = self._outcome(rank, task_id, offsets[rank])
                if outcome is None:
                    continue
                pending.discard(rank)
                if isinstance(outcome, Fault):
                    faults.append(outcome)
                    deadline = min(deadline, time.monotonic() + FAULT_GRACE_S)
                else:
                    done[rank] = outcome
        return done, faults, pending

    def _outcome(self, rank: int, task_id: int, offset: int) -> bytes | Fault | None:
        conn, proc = self.conns[rank], self.procs[rank]
        if conn.poll():  # a message, or EOF if the rank died
            try:
                message = receive(conn)
            except (EOFError, OSError):
                message = None
            if isinstance(message, TaskDone) and message.task_id == task_id:
                return message.value
            if isinstance(message, TaskFailed) and message.task_id == task_id:
                return Fault(rank, message.error.stage, message.error.action, error=message.error)
            if message is not None:
                return None  # a reply to an earlier task; keep waiting
        await_exit_status(proc)  # EOF can come a moment before the exit status
        assert self.board is not None
        stage, action = self.board.read(rank)
        return Fault(
            rank, stage, action, exitcode=proc.exitcode, last_words=self._read_stack(rank, offset)
        )

    def _timeout_error(
        self, pending: set[int], offsets: dict[int, int], task: str, timeout: float
    ) -> RankTimeoutError:
        assert self.board is not None
        stacks = self.dump_stacks(offsets)
        n = self.properties.world_size
        doing = {rank: where(*self.board.read(rank)) for rank in range(n)}
        return timeout_error(pending, stacks, doing, task, n, timeout, RESTART_NOTE)

    def _stack_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.stack_path(rank))
        except OSError:
            return 0

    def _read_stack(self, rank: int, offset: int) -> str:
        try:
            with open(self.stack_path(rank), errors="replace") as stack_file:
                stack_file.seek(offset)
                text = stack_file.read()
        except OSError:
            return ""
        # faulthandler dumps one block per thread; the parent watchdog's is noise.
        blocks = text.split("\n\n")
        return "\n\n".join(b for b in blocks if "in _exit_when_orphaned" not in b)

    def dump_stacks(self, offsets: dict[int, int]) -> dict[int, str]:
        """Every live rank's Python stack, written by faulthandler on SIGUSR1."""
        live = {r for r, proc in enumerate(self.procs) if proc.is_alive() and r in offsets}
        for rank in live:
            try:
                os.kill(self.procs[rank].pid or 0, signal.SIGUSR1)
            except OSError:
                live.discard(rank)
        deadline, previous, unchanged = time.monotonic() + STACK_WAIT_S, None, 0
        while time.monotonic() < deadline:  # until every file has grown and stopped growing
            sizes = {r: self._stack_size(r) for r in live}
            unchanged = unchanged + 1 if sizes == previous else 0
            # 0.2 s unchanged: a rank descheduled mid-dump on a busy machine is not cut short
            if unchanged >= 4 and all(sizes[r] > offsets[r] for r in live):
                break
            previous = sizes
            time.sleep(0.05)
        stacks = {r: self._read_stack(r, offset) for r, offset in offsets.items()}
        full = disk_problem(self.tmpdir) if not all(stacks.values()) else None
        unanswered = f"the rank could not write it: {full}" if full else "the process did not answer SIGUSR1"
        return {r: text or f"(no stack: {unanswered})" for r, text in stacks.items()}

    def stop(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    send(conn, Shutdown())
                except OSError:
                    pass
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate() if graceful else proc.kill()
        deadline = time.monotonic() + KILL_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(KILL_GRACE_S)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.board = [], [], None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(proc.pid or 0 for proc in self.procs)

    def dead_ranks(self) -> dict[int, int | None]:
        """The exit status of every started rank that is no longer running (waits only for a dead one's status)."""
        dead = {}
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is None and process_gone(proc.pid or 0):
                await_exit_status(proc)  # gone from /proc a moment before its status reaches us
            if proc.exitcode is not None or process_gone(proc.pid or 0):
                dead[rank] = proc.exitcode
        return dead
