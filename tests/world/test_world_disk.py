"""A World on a full disk says so, with the folder and the fix, at start and when a hang is reported;
and a killed driver leaves nothing of pipecheck's in TMPDIR (no pymp-* folder, no World folder once a
later World has started)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipecheck._world.tempdirs as tempdirs
from pipecheck._world.tempdirs import sweep_stale_tmpdirs
from pipecheck._world.world import World
from pipecheck.errors import RankTimeoutError, WorldStartError

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
import _world_jobs as jobs  # noqa: E402


def _short_folder() -> Path:
    """A new folder with a short path: the forkserver's socket lives in TMPDIR, and a socket's path
    holds 107 bytes at most (pytest's tmp_path can be 90)."""
    return Path(tempfile.mkdtemp(prefix="pc-", dir="/tmp" if os.path.isdir("/tmp") else None))


@pytest.fixture
def own_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """TMPDIR set to a folder of this test's, as a user would set it (multiprocessing's folder of this
    process, which outlives the test with the forkserver's socket, is made where it was before)."""
    tempdirs.own_multiprocessing_tempdir()
    folder = _short_folder()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(("free", "said"), [((0, 10**6), "has 0 bytes free"), ((10**9, 0), "has no free inodes")],
                         ids=["no-bytes", "no-inodes"])
def test_a_full_temp_disk_is_named_before_a_rank_starts(
    own_tmpdir: Path, monkeypatch: pytest.MonkeyPatch, free: tuple[int, int], said: str
) -> None:
    monkeypatch.setattr(tempdirs, "free_space", lambda path: free)
    world = World(2, start_timeout=60)
    with pytest.raises(WorldStartError) as refused:
        world.__enter__()
    world.close()
    assert str(refused.value) == (
        f"Could not start World(2, device='cpu') (backend gloo, devices cpu, cpu): TMPDIR={own_tmpdir} {said}: a "
        "World writes its rendezvous file, its ranks' stacks and multiprocessing's socket there. Fix: free space on "
        "that disk, or set TMPDIR to a folder on a disk with room."
    )
    assert os.listdir(own_tmpdir) == []  # nothing was made there


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (ENOSPC on every write)")
@pytest.mark.parametrize("disk_full", [True, False], ids=["full", "room"])
def test_a_hang_whose_stacks_cannot_be_written_names_the_full_disk(
    own_tmpdir: Path, monkeypatch: pytest.MonkeyPatch, disk_full: bool
) -> None:
    with World(2, timeout=60) as world:
        if disk_full:  # the ranks' stack dumps fail with ENOSPC (/dev/full); the probe says the disk is full
            monkeypatch.setattr(tempdirs, "free_space", lambda path: (0, 10**6))
        with pytest.raises(RankTimeoutError) as hung:
            world.run(jobs.hang_without_writable_stacks, timeout=3)
    stackless = [line.strip() for line in str(hung.value).splitlines() if line.strip().startswith("(no stack")]
    assert stackless == 2 * [
        f"(no stack: the rank could not write it: TMPDIR={own_tmpdir} has 0 bytes free: a World writes its rendezvous file, "
        "its ranks' stacks and multiprocessing's socket there. Fix: free space on that disk, or set TMPDIR to a "
        "folder on a disk with room.)" if disk_full else "(no stack: the process did not answer SIGUSR1)"
    ]


FULL_DISK_DRIVER = """
import os, sys, tempfile
sys.path.insert(0, {tests!r})
import _world_jobs as jobs
from pipecheck._world.world import World
from pipecheck.errors import RankTimeoutError, WorldStartError

def fill(folder):
    try:
        with open(os.path.join(folder, "filler"), "wb") as filler:
            while True:
                filler.write(bytes(1 << 16))
                filler.flush()
    except OSError as error:
        return error.strerror

if __name__ == "__main__":
    with World(2, timeout=60, start_timeout=60) as world:
        world.run(jobs.echo)
        os.write(1, ("filled: " + fill(sys.argv[1]) + "\\n").encode())
        try:
            world.run(jobs.hang_on_rank, 1, timeout=3)
        except RankTimeoutError as error:
            os.write(1, ("hang: " + repr(str(error)) + "\\n").encode())
    try:
        World(2, start_timeout=60).__enter__()
    except WorldStartError as error:
        os.write(1, ("start: " + str(error) + "\\n").encode())
"""


def _can_mount_a_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs `unshare -rm` (a user namespace) to mount a small tmpfs")
def test_a_really_full_tmpfs_is_named_in_a_hang_and_at_start(tmp_path: Path, own_tmpdir: Path) -> None:
    script, disk = tmp_path / "driver.py", own_tmpdir
    script.write_text(textwrap.dedent(FULL_DISK_DRIVER.format(tests=str(TESTS_DIR))))
    env = dict(os.environ, TMPDIR=str(disk), PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
    inside = f"mount -t tmpfs -o size=4m tmpfs {disk} && exec {sys.executable} {script} {disk}"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", inside], capture_output=True, text=True, env=env,
                          timeout=300)
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.split(": ")[0] in
                ("filled", "hang", "start"))
    assert said.get("filled") == "No space left on device", done.stderr[-3000:]
    full = rf"TMPDIR={re.escape(str(disk))} has \d+ bytes free"  # a page or two, as the World's folder comes and goes
    assert re.search(rf"\(no stack: the rank could not write it: {full}", said["hang"])  # rank 1 hung: no room for its stack
    assert re.match(rf"Could not start World\(2, device='cpu'\) \(backend gloo, devices cpu, cpu\): {full}", said["start"])
    assert "Fix: free space on that disk, or set TMPDIR to a folder on a disk with room." in said["start"]


KILLED_DRIVER = """
import os, sys, time
sys.path.insert(0, {tests!r})
import _world_jobs as jobs
from pipecheck._world.world import World

if __name__ == "__main__":
    world = World(2, timeout=60, start_timeout=60)
    pids = world.run(jobs.pid)
    os.write(1, ("pids: " + " ".join(map(str, pids)) + "\\n").encode())
    world.run(jobs.sleep, 600, timeout=900)
"""


def _pipecheck_s(folder: Path) -> list[str]:
    """What pipecheck and multiprocessing leave in a temporary folder (torch's own caches aside)."""
    return sorted(name for name in os.listdir(folder) if name.startswith(("pymp-", "pipecheck-", "pcmp-")))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_driver_leaves_nothing_in_tmpdir_once_a_world_starts_again(
    tmp_path: Path, own_tmpdir: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    script, temp = tmp_path / "driver.py", own_tmpdir
    script.write_text(textwrap.dedent(KILLED_DRIVER.format(tests=str(TESTS_DIR))))
    env = dict(os.environ, TMPDIR=str(temp), PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None
        line = next((line for line in driver.stdout if line.startswith("pids: ")), "")
        assert line, f"the driver exited ({driver.wait(timeout=60)}) without starting its World"
        while_running = _pipecheck_s(temp)
        driver.send_signal(signum)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=60)
    # the World's folder and multiprocessing's (the forkserver's socket), both named for the sweep; no pymp-*
    assert [name.rsplit("-", 1)[0] for name in while_running] == [f"pcmp-{driver.pid}", f"pipecheck-world-{driver.pid}"]
    deadline = time.monotonic() + 30  # the ranks' watchdog polls every 0.5 s
    while any(os.path.exists(f"/proc/{pid}") for pid in map(int, line.split()[1:])) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _pipecheck_s(temp)
    if signum == signal.SIGTERM:
        assert left == []  # the driver's SIGTERM handler stopped its World and removed both folders
    else:
        assert left == while_running  # no exit hook ran
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        sweep_stale_tmpdirs()  # what the next World's start does first
        assert _pipecheck_s(temp) == []
