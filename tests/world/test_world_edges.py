"""World hygiene against other local users and dead drivers: temp folders parsed defensively and
owned per user, layouts unpickled only under the World's key, a zombie driver counted as dead."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _world_jobs import Planted

import pipecheck as pc

# private: the runtime's links are built on a World
from pipecheck._runtime.comm import Links, layout_of
from pipecheck._world.spawn import EXIT_STATUS_WAIT_S, KILL_GRACE_S, await_exit_status
from pipecheck._world.tempdirs import TMPDIR_PREFIX, sweep_stale_tmpdirs
from pipecheck._world.worker import process_gone
from pipecheck.errors import RankDiedError

CPU = torch.device("cpu")


def test_odd_and_foreign_temp_folders_never_stop_a_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    odd = [f"{TMPDIR_PREFIX}99999999999999999999-x", f"{TMPDIR_PREFIX}-x", f"{TMPDIR_PREFIX}12a-x"]
    for name in odd:
        (tmp_path / name).mkdir()
    (tmp_path / f"{TMPDIR_PREFIX}4194305-file").write_text("not a folder")  # a pid above pid_max, as a file
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{TMPDIR_PREFIX}{dead.pid}-abcd"
    stale.mkdir()
    sweep_stale_tmpdirs()  # raised OverflowError on the first name
    assert not stale.exists()  # ours, and its driver is gone
    assert all((tmp_path / name).exists() for name in odd)
    assert (tmp_path / f"{TMPDIR_PREFIX}4194305-file").exists()


def test_another_user_s_stale_folder_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    theirs = tmp_path / f"{TMPDIR_PREFIX}4194305-abcd"
    theirs.mkdir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(theirs).st_uid + 1)
    sweep_stale_tmpdirs()
    assert theirs.exists()


def test_a_folder_removed_while_it_is_swept_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another World's driver (an xdist worker, a script) removes its own folder whenever it closes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    closing = tmp_path / f"{TMPDIR_PREFIX}{os.getpid()}-abcd"  # a live driver's: not swept
    closing.mkdir()
    lstat = os.lstat

    def lstat_then_close(path: str) -> os.stat_result:
        found = lstat(path)
        if Path(path) == closing:
            closing.rmdir()  # its driver's close(), right after the sweep looked
        return found

    monkeypatch.setattr(os, "lstat", lstat_then_close)
    sweep_stale_tmpdirs()  # raised FileNotFoundError, from World.run()
    assert not closing.exists()


class _Rank:
    """A rank process whose exit status its forkserver reports ``after`` seconds from now (or never)."""

    def __init__(self, pid: int, after: float) -> None:
        self.pid, self.exitcode, self.reported_at = pid, None, time.monotonic() + after

    def join(self, timeout: float) -> None:
        time.sleep(max(0.0, min(timeout, self.reported_at - time.monotonic())))
        if time.monotonic() >= self.reported_at:
            self.exitcode = -signal.SIGKILL


def test_a_dead_ranks_status_is_waited_for_on_a_busy_machine() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    late = _Rank(dead.pid, after=KILL_GRACE_S + 1)  # the forkserver was not scheduled for 2 s
    await_exit_status(late)  # type: ignore[arg-type]
    assert late.exitcode == -signal.SIGKILL  # was None: "rank 1 closed its pipe ... did not exit"
    alive = _Rank(os.getpid(), after=600)  # still running (exiting, or hung): KILL_GRACE_S, not more
    started = time.monotonic()
    await_exit_status(alive)  # type: ignore[arg-type]
    assert alive.exitcode is None and time.monotonic() - started < EXIT_STATUS_WAIT_S


GLOO_QUIET_SCRIPT = """
import ctypes, os, sys
import pipecheck._world.worker as worker

worker._GLOO_PRINTS_CONNECTIONS = True  # as on torch 2.10, whatever torch runs this
print("kept", end="")  # held in Python's buffer when the block starts
with worker.gloo_connections_unprinted():
    os.write(1, b"[Gloo] written at once\\n")
    ctypes.CDLL(None).printf(b"[Gloo] held in C's buffer")
    sys.stdout.flush()  # as anything in the block may: "kept" must be out already
print(" and after")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are made on Linux")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
def test_what_gloo_prints_while_a_group_is_made_never_reaches_stdout(unbuffered: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}  # "1" also leaves C's stdout unbuffered
    done = subprocess.run([sys.executable, "-c", GLOO_QUIET_SCRIPT], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "kept and after\n"


def test_a_zombie_driver_is_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not process_gone(child.pid):  # exited and not reaped: a zombie, which kill(pid, 0) still finds
        assert time.monotonic() < deadline, "the exited child was never seen as gone"
        time.sleep(0.05)
    os.kill(child.pid, 0)  # the zombie is still there ...
    child.wait()  # ... until reaped
    assert process_gone(child.pid)
    assert not process_gone(os.getpid())
    assert process_gone(2**40)  # no such pid: never an OverflowError


def _links(secret: bytes) -> Links:
    pipe = pc.split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), (torch.randn(2, 4),),
                    split_spec={"1": pc.SplitPoint.BEGINNING})
    return Links(pipe, (0, 1), CPU, CPU, secret)


def test_a_layout_without_the_world_s_tag_is_refused_before_it_is_unpickled() -> None:
    receiver = _links(b"k" * 32)
    channel = next(iter(receiver.channel_ids))
    tag = 1
    for forged in (b"\0" * 32 + pickle.dumps(Planted()), _links(b"other key").signed(pickle.dumps(Planted()), tag),
                   _links(b"k" * 32).signed(pickle.dumps(Planted()), tag + 64),  # another message's tag
                   b"garbage"):
        with pytest.raises(pc.EngineError, match="failed authentication: it was not sent by a rank of this World"):
            receiver.verified(forged, channel, 0, tag)
    assert not Planted.ran
    layout = pickle.dumps(layout_of(torch.zeros(2, 4)))
    assert receiver.verified(_links(b"k" * 32).signed(layout, tag), channel, 0, tag) == layout


def test_ranks_of_a_world_share_its_key_and_run_the_pipeline() -> None:
    report = pc.assert_equivalent(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), (torch.randn(4, 4),),
                                  split_spec={"1": pc.SplitPoint.BEGINNING}, n_microbatches=2)
    assert report.ok


DRIVER = """
import os, sys, time
sys.path.insert(0, {tests!r})
import _world_jobs
import pipecheck as pc

if __name__ == "__main__":
    with pc.World(2, start_timeout=120) as world:
        os.write(1, ("driver: " + " ".join(map(str, world.run(_world_jobs.pid))) + "\\n").encode())
        time.sleep(600)
"""


def _driver_says(driver: subprocess.Popen[str]) -> list[str]:
    """The driver script's own line (the ranks share its stdout: gloo may print there first)."""
    for line in driver.stdout:  # type: ignore[union-attr]
        if line.startswith("driver: "):
            return line.split()[1:]
    raise AssertionError(f"the driver exited ({driver.wait(timeout=30)}) without printing its line")


def test_ranks_exit_when_their_driver_is_killed_and_left_a_zombie(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=str(Path(__file__).resolve().parents[1])))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(pid) for pid in _driver_says(driver)]
        assert len(ranks) == 2
        driver.kill()  # SIGKILL, and not reaped: the driver stays a zombie while we look
        deadline = time.monotonic() + 30
        while not all(process_gone(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived their zombie driver"
            time.sleep(0.1)
        assert driver.poll() is None or driver.returncode == -9  # poll() reaps it: only now
    finally:
        driver.kill()
        driver.wait(timeout=30)


SIGTERMED = """
import os, sys, time, signal
sys.path.insert(0, {tests!r})
import _world_jobs
import pipecheck as pc

if __name__ == "__main__":
    {own_handler}
    world = pc.World(2, start_timeout=120)
    words = [world._ranks.tmpdir, *world.run(_world_jobs.pid)]
    os.write(1, ("driver: " + " ".join(map(str, words)) + "\\n").encode())
    time.sleep(600)
"""


@pytest.mark.parametrize("own_handler", [False, True], ids=["default", "user-handler"])
def test_sigterm_to_the_driver_cleans_up_like_ctrl_c(tmp_path: Path, own_handler: bool) -> None:
    script = tmp_path / "driver.py"
    handler = "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))" if own_handler else "pass"
    script.write_text(SIGTERMED.format(tests=str(Path(__file__).resolve().parents[1]), own_handler=handler))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        folder, *ranks = _driver_says(driver)
        driver.terminate()
        assert driver.wait(timeout=60) == (7 if own_handler else -15)  # the user's handler is kept
        deadline = time.monotonic() + 30
        while not all(process_gone(int(pid)) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived the SIGTERMed driver"
            time.sleep(0.1)
        if not own_handler:
            assert not Path(folder).exists(), "SIGTERM left the World's temp folder"
    finally:
        driver.kill()
        driver.wait(timeout=30)


def test_a_killed_forkserver_is_named_not_blamed_on_rank_0() -> None:
    import multiprocessing.forkserver

    import _world_jobs

    with pc.World(2, start_timeout=120) as world:
        if os.environ.get("PIPECHECK_START_METHOD", "forkserver") != "forkserver" or sys.platform != "linux":
            pytest.skip("ranks here do not start from a forkserver")
        ranks = world.run(_world_jobs.pid)
        os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, 9)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while not all(process_gone(pid) for pid in ranks):  # they die with it (PR_SET_PDEATHSIG)
            assert time.monotonic() < deadline, "the ranks outlived their forkserver"
            time.sleep(0.1)
        with pytest.raises(pc.WorldError) as info:
            world.run(_world_jobs.pid)
        message = str(info.value)
        assert "pipecheck's forkserver (pid " in message and "is gone" in message
        assert "No rank is at fault." in message and "Fix rank 0" not in message
        assert len(world.run(_world_jobs.pid)) == 2  # a new forkserver starts


def test_an_engine_hang_names_the_rank_that_hung_not_one_waiting_for_it() -> None:
    import _odd_models

    with pytest.raises(pc.EngineError) as info:
        pc.assert_equivalent(_odd_models.HangsOnRank1, (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING},
                             n_microbatches=2, runner="torch", timeout=15, tracer="fx")
    assert info.value.rank == 1, str(info.value)
    assert "(rank 1 hung (0 waiting for it), stuck;" in str(info.value).splitlines()[0]


def test_a_hang_on_a_reused_split_with_an_autograd_function_is_one_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split reused from an earlier check calls a custom autograd.Function: a hang is one timeout (it was
    taken for a changed model and the check ran again: two timeouts)."""
    import _odd_models

    # private: counted where every World engine runs its ranks
    from pipecheck._runners.engine import EngineRunner

    runs = []
    real = EngineRunner.run
    monkeypatch.setattr(EngineRunner, "run", lambda self, *args: runs.append(1) or real(self, *args))
    check = functools.partial(pc.assert_equivalent, _odd_models.ReversedHangsOnRank1, (torch.randn(4, 4),),
                              split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2, tracer="fx")
    check(runner="reference")
    with pytest.raises(pc.EngineError, match=r"did not finish within 5 s \(rank 1 hung"):
        check(runner="torch", timeout=5)
    assert runs == [1]


def test_the_default_runner_s_timeout_names_the_hung_rank_and_its_stack_first() -> None:
    import _odd_models

    with pytest.raises(pc.RankTimeoutError) as info:
        pc.assert_equivalent(_odd_models.HangsInStage1, (torch.randn(4, 4),),
                             split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2, timeout=8, tracer="fx")
    message = str(info.value)
    assert info.value.hung == 1, message
    assert message.splitlines()[0].endswith(": rank 1 of 2 hung, in stage 1 (action '1F0') "
                                            "(rank(s) 0 waiting for it)."), message
    assert message.splitlines()[1] == "Python stack of rank 1, where it hung:"
    assert message.index("in _sleep_on_rank_1") < message.index("--- rank 0 (still running) ---")
    assert "Fix what rank 1 is doing first" in message


def test_the_hung_rank_is_the_one_whose_main_thread_is_not_in_communication() -> None:
    from pipecheck._world.faults import hung_rank

    sep = os.sep
    waiting = ("Thread 0x01 (most recent call first):\n  <no Python frame>\n"
               "Thread 0x02 (most recent call first):\n  File \"/x/pipecheck/_world/worker.py\", line 9 in _exit_when_orphaned\n"
               f"Current thread 0x03 (most recent call first):\n  File \"/x/torch{sep}distributed{sep}distributed_c10d.py\""
               ", line 1 in recv\n  File \"/x/torch/distributed/pipelining/schedules.py\", line 2 in step\n")
    hung = waiting.replace(f"/x/torch{sep}distributed{sep}distributed_c10d.py\", line 1 in recv",
                           "/home/me/model.py\", line 7 in forward")
    assert hung_rank((0, 1), {0: waiting, 1: hung}) == 1
    assert hung_rank((0, 1), {0: hung, 1: hung}) is None  # two: no guess
    assert hung_rank((0, 1), {0: waiting, 1: waiting}) is None
    # pipecheck's runtime waits on a posted receive: work.wait() is C, its innermost Python frame is comm.py
    in_runtime = waiting.replace(f"/x/torch{sep}distributed{sep}distributed_c10d.py\", line 1 in recv",
                                 f"/x/pipecheck{sep}_runtime{sep}comm.py\", line 235 in _wait")
    assert hung_rank((0, 1), {0: in_runtime, 1: hung}) == 1


def test_ranks_that_died_between_tasks_are_named_before_a_task_is_sent() -> None:
    import _world_jobs

    with pc.World(2, start_timeout=120) as world:
        pids = world.run(_world_jobs.pid)
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not process_gone(pids[1]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(RankDiedError) as info:
            world.run(_world_jobs.pid)
        assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
        assert "rank(s) 1 of 2 died while the World was idle, between tasks: rank 1 was killed by SIGKILL" in str(info.value)
        assert "was not sent, so nothing of it ran" in str(info.value)
        assert len(world.run(_world_jobs.pid)) == 2  # fresh ranks


def test_the_shared_pool_replaces_a_world_that_lost_a_rank_while_idle() -> None:
    import _world_jobs

    world = pc.World.shared(2)
    pids = world.run(_world_jobs.pid)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not process_gone(pids[0]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again = pc.World.shared(2)
    assert again is not world and world.closed
    assert set(again.run(_world_jobs.pid)).isdisjoint(pids)
