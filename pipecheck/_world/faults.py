"""How a task's faults read: which rank raised, died or hung, doing what, and what to fix first.

    raise fault_error(faults, still_running, task, world_size, RESTART_NOTE)
    raise timeout_error(pending, stacks, doing, task, world_size, timeout, RESTART_NOTE)

A death is reported before the errors it caused; a forkserver killed from outside is named as
such, not blamed on rank 0; of ranks that time out, the one not waiting for a peer is named first,
with its stack (every engine's timeout reads the same: it is the World's).
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipecheck._world.worker import PeersUnproven, process_gone
from pipecheck.errors import (
    RankDiedError,
    RankError,
    RankFailedError,
    RankTimeoutError,
    WorldError,
    WorldStartError,
)


def where(stage: int | None, action: str | None) -> str:
    text = "no stage set" if stage is None else f"stage {stage}"
    return text + (f" (action {action!r})" if action else "")


def indent(text: str) -> str:
    return "".join("    " + line for line in text.rstrip().splitlines(keepends=True))


def exit_status(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe to the driver but did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode} (os._exit(), or a native library calling exit())"


def _death_hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return "A SIGKILL nobody sent is usually the out-of-memory killer (check `dmesg`)."
    if exitcode in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT, -signal.SIGFPE):
        return "This is a crash in native code (a C/C++ extension, CUDA or torch); the faulthandler output shows the Python line that called it."
    return "Check the rank's stderr above for what it printed before exiting."


@dataclass
class Fault:
    """One rank that raised (``error`` set) or died (``exitcode``) during a task."""

    rank: int
    stage: int | None
    action: str | None
    error: RankError | None = None
    exitcode: int | None = None
    last_words: str = ""  # faulthandler output written as it died


_STATUS_UNKNOWN = 255  # what multiprocessing reports for a forkserver child whose forkserver died


def dead_forkserver() -> int | None:
    """The pid of the forkserver that started the ranks, if it has died (None: alive, or none used)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)  # the module's own single server
    pid = getattr(server, "_forkserver_pid", None)
    return pid if isinstance(pid, int) and process_gone(pid) else None


def fault_error(
    faults: list[Fault], still_running: set[int], task: str, world_size: int, recovery: str
) -> WorldError:
    # A death is the cause, never a consequence, of the others' errors (a peer's
    # "Connection closed" may even reach the driver first): report deaths first.
    ordered = sorted(faults, key=lambda fault: fault.error is not None)
    first, others = ordered[0], ordered[1:]
    doing = where(first.stage, first.action)
    if first.error is not None:
        lines = [
            f"rank {first.rank} of {world_size} raised {first.error.summary} while running {doing} of task {task}.",
            f"Traceback on rank {first.rank}:",
            indent(first.error.traceback),
        ]
    elif first.exitcode == _STATUS_UNKNOWN and (server := dead_forkserver()) is not None:
        return RankDiedError(
            f"pipecheck's forkserver (pid {server}), which started the ranks and reports how they exit, is gone "
            f"(killed from outside?): every rank of {world_size} was stopped with it while running task {task}, "
            f"and their exit statuses are unknown (multiprocessing reports {_STATUS_UNKNOWN}). No rank is at fault. "
            f"{recovery} Fix: run again (a new forkserver starts), and leave pipecheck's forkserver process running.",
            first.rank, first.exitcode, first.stage)
    else:
        lines = [
            f"rank {first.rank} of {world_size} died while running {doing} of task {task}: "
            f"it {exit_status(first.exitcode)}.",
            _death_hint(first.exitcode),
        ]
        if first.last_words.strip():
            lines += [f"faulthandler output of rank {first.rank}:", indent(first.last_words)]
    for fault in others:
        what = fault.error.summary if fault.error else "it " + exit_status(fault.exitcode)
        lines.append(
            f"Then rank {fault.rank} ({where(fault.stage, fault.action)}): {what} (probably a consequence)."
        )
    if still_running:
        ranks = ", ".join(map(str, sorted(still_running)))
        lines.append(
            f"Still running when stopped: rank(s) {ranks} (probably waiting for rank {first.rank})."
        )
    lines.append(f"{recovery} Fix rank {first.rank}'s problem first.")
    message = "\n".join(lines)
    if first.error is not None:
        return RankFailedError(message, first.error)
    return RankDiedError(message, first.rank, first.exitcode, first.stage)


def idle_death_error(exitcodes: dict[int, int | None], task: str, world_size: int, recovery: str) -> RankDiedError:
    """Ranks found dead when ``task`` was about to be sent: they died between tasks, not in it."""
    rank = min(exitcodes)
    ranks = ", ".join(map(str, sorted(exitcodes)))
    if exitcodes[rank] == _STATUS_UNKNOWN and (server := dead_forkserver()) is not None:
        cause = (f"pipecheck's forkserver (pid {server}), which started them, is gone (killed from outside?) "
                 "and they were stopped with it. No rank is at fault. Leave pipecheck's forkserver process running.")
    elif exitcodes[rank] is None:  # gone from /proc, its status not yet reported by its parent
        cause = f"rank {rank} is gone (its exit status was not reported). {_death_hint(None)}"
    else:
        cause = f"rank {rank} {exit_status(exitcodes[rank])}. {_death_hint(exitcodes[rank])}"
    return RankDiedError(
        f"rank(s) {ranks} of {world_size} died while the World was idle, between tasks: {cause} "
        f"Task {task} was not sent, so nothing of it ran. {recovery}",
        rank, exitcodes[rank], None)


# Where a rank that waits for a peer blocks: torch.distributed's Python functions (recv, barrier,
# all_reduce), or pipecheck's runtime waiting on a posted receive (``work.wait()`` is C: the innermost
# Python frame is pipecheck's own).
_COMMUNICATION = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}pipecheck{os.sep}_runtime{os.sep}comm.py")


def hung_rank(ranks: Iterable[int], stacks: Mapping[int, str]) -> int | None:
    """Of the ranks still running at a timeout, the one not blocked in communication: the others wait
    in a receive or a collective for it. None when none or several are elsewhere (no guess)."""
    elsewhere = [rank for rank in ranks if not _in_communication(stacks.get(rank, ""))]
    return elsewhere[0] if len(elsewhere) == 1 else None


def _in_communication(stack: str) -> bool:
    """Whether a faulthandler dump (a block per thread, "Current thread ..." the one that took the
    signal: the main thread; its "File ..." lines innermost first) shows the rank blocked in
    communication. Without a current thread's block, any thread blocked there counts."""
    blocks: list[list[str]] = []
    for line in stack.splitlines():
        text = line.strip()
        if text.startswith(("Thread ", "Current thread ")):
            blocks.append([text])
        elif blocks and text.startswith('File "'):
            blocks[-1].append(text)
    current = [block for block in blocks if block[0].startswith("Current thread ")]
    return any(len(block) > 1 and any(part in block[1] for part in _COMMUNICATION) for block in current or blocks)


def timeout_error(pending: set[int], stacks: Mapping[int, str], doing: Mapping[int, str], task: str,
                  world_size: int, timeout: float, recovery: str) -> RankTimeoutError:
    """A task's timeout: the rank that hung and its stack first, when one rank is stuck outside
    communication while the others wait for it; then every rank's state and the others' stacks.
    ``doing``: where each rank was (its stage and action)."""
    hung = hung_rank(sorted(pending), stacks)
    waiting = sorted(pending - {hung}) if hung is not None else []
    if hung is not None:
        lines = [f"task {task} did not finish within {timeout} s: rank {hung} of {world_size} hung, in "
                 f"{doing[hung]}" + (f" (rank(s) {', '.join(map(str, waiting))} waiting for it)" if waiting else "")
                 + ".",
                 f"Python stack of rank {hung}, where it hung:", indent(stacks[hung])]
    else:
        ranks = ", ".join(map(str, sorted(pending)))
        lines = [f"task {task} did not finish within {timeout} s on rank(s) {ranks} of {world_size}."]
    lines += [f"rank {rank}: " + (f"still running, {doing[rank]}" if rank in pending else "finished")
              for rank in range(world_size)]
    lines.append(
        f"{recovery} " + (f"Fix what rank {hung} is doing first: the others only wait for it." if hung is not None
                          else "Look below for where the unfinished ranks are stuck: a send/recv whose peer never "
                          "posts the matching call, or a collective that not every rank entered, is the usual "
                          "cause.") + " If the task is only slow, pass run(..., timeout=SECONDS).")
    lines.append(f"Python stack of every {'other ' if hung is not None else ''}rank at the timeout:")
    for rank in range(world_size):
        if rank != hung:
            lines += [f"--- rank {rank} ({'still running' if rank in pending else 'finished'}) ---",
                      indent(stacks[rank])]
    return RankTimeoutError("\n".join(lines), tuple(sorted(pending)), dict(stacks), timeout, hung=hung)


def start_error(world: str, problems: list[str], unproven: list[PeersUnproven], full: str | None) -> WorldStartError:
    """Why the ranks of ``world`` (``World(2, device='cpu') (backend gloo, ...)``) did not all join:
    connections taken by a process outside the World first, then each rank's own problem, then a full
    disk (which makes the ranks fail in ways of their own) or the usual suspects."""
    if unproven:
        lines = [f"Could not start {world}: the connections between its ranks did not all reach this World's "
                 "ranks. Each rank proves itself to every other with this World's key right after they "
                 "connect, and these did not:"]
        for report in sorted(unproven, key=lambda report: report.rank):
            lines += [f"rank {report.rank}, {problem}" for problem in report.problems]
        holders: dict[str, list[str]] = {}
        for address, holder in sorted({held for report in unproven for held in report.foreign}):
            holders.setdefault(holder, []).append(address)
        for holder, addresses in holders.items():
            shown = ", ".join(addresses[:4]) + (f" and {len(addresses) - 4} more" if len(addresses) > 4 else "")
            lines.append(f"Held by a process outside the World: {len(addresses)} connection(s) to these ranks, "
                         f"from {shown}: {holder}.")
        lines.append(
            "A rank's gloo port takes the first connection that names itself a peer, and any local user can connect "
            "to 127.0.0.1: another process took a peer's place while the ranks started. No task ran, and every "
            "rank was stopped. Fix: find that process (`ss -tnp`; the ports are above) and stop it, or run on a "
            "host (or in a container) where no one else can reach this host's loopback ports; then start the "
            "World again."
        )
        return WorldStartError("\n".join(lines + problems))
    hint = (f"The disk is full: {full}" if full else
            "If gloo cannot bind an address, set GLOO_SOCKET_IFNAME; if startup is just slow, raise start_timeout.")
    return WorldStartError(f"Could not start {world}:\n" + "\n".join(problems) + "\n" + hint)
