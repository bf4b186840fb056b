"""The World's temporary folders: one per World, this user's own, swept when their driver is gone.

    tmpdir = make_tmpdir()          # $TMPDIR/pipecheck-world-<driver pid>-<random>, mode 0700
    sweep_stale_tmpdirs()           # this user's folders whose driver was killed (no close() ran)
    own_multiprocessing_tempdir()   # multiprocessing's pymp-* folder, made one of ours: pcmp-<pid>-*
    disk_problem(tmpdir)            # "TMPDIR=/x has 0 bytes free: ... Fix: ..." or None
"""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import shutil
import stat
import tempfile

from pipecheck._world.worker import process_gone
from pipecheck.errors import WorldStartError

TMPDIR_PREFIX = "pipecheck-world-"  # then the driver's pid: pipecheck-world-1234-abcd
MP_PREFIX = "pcmp-"  # then the driver's pid: multiprocessing's folder, short as its socket's path must be
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the final NUL (Linux; macOS: 104)
# Below this a World may not start: its rendezvous file, its ranks' stack dumps (a few KiB a rank
# each time a hang is reported) and multiprocessing's socket all live in the temporary folder.
LOW_DISK_BYTES = 1 << 20


def make_tmpdir() -> str:
    """A new folder for one World (its file store, its ranks' stack dumps); only this user can enter it."""
    try:
        return tempfile.mkdtemp(prefix=f"{TMPDIR_PREFIX}{os.getpid()}-")  # mkdtemp: mode 0700
    except OSError as error:
        raise WorldStartError(_cannot_write(error)) from error


def own_multiprocessing_tempdir() -> None:
    """Give multiprocessing's folder of this process (the forkserver's socket; what its heap spills)
    a name the sweep knows, ``pcmp-<pid>-*``: left to itself multiprocessing makes ``pymp-*``,
    removed at a clean exit only, so one piles up in TMPDIR after every SIGTERM or SIGKILL. A folder
    that multiprocessing has already (the user's own use of it) is left as it is, and so is a
    TMPDIR so long that the forkserver's socket path would not fit in ours."""
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is not None:
        return
    prefix = f"{MP_PREFIX}{os.getpid()}-"
    if len(os.path.join(tempfile.gettempdir(), prefix)) + len("12345678/listener-12345678") > _SOCKET_PATH_MAX - 4:
        return
    try:
        path = tempfile.mkdtemp(prefix=prefix)
    except OSError as error:
        raise WorldStartError(_cannot_write(error)) from error
    config["tempdir"] = path
    # As multiprocessing's own: removed at exit, after the forkserver that listens in it has stopped.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                  exitpriority=-100)


def remove_multiprocessing_tempdir() -> None:
    """Remove the folder :func:`own_multiprocessing_tempdir` made (a driver dying of SIGTERM runs no
    exit hooks); multiprocessing makes another if this process needs one again."""
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    path = config.get("tempdir")
    if isinstance(path, str) and os.path.basename(path).startswith(f"{MP_PREFIX}{os.getpid()}-"):
        shutil.rmtree(path, ignore_errors=True)
        config.pop("tempdir", None)


def sweep_stale_tmpdirs() -> None:
    """Remove this user's temporary directories of worlds whose driver was killed (no close() ran), and
    the multiprocessing folders of those drivers.

    Another user's directories, and names that only look like ours, are never touched and never
    raise: anyone can create ``pipecheck-world-99999999999999999999-x`` in a shared temp folder.
    """
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return  # make_tmpdir names what is wrong with the folder
    for name in names:
        prefix = next((prefix for prefix in (TMPDIR_PREFIX, MP_PREFIX) if name.startswith(prefix)), None)
        driver = name[len(prefix) :].split("-", 1)[0] if prefix else ""
        if not (driver.isdigit() and len(driver) <= 10):
            continue
        path = os.path.join(root, name)
        try:
            found = os.lstat(path)  # once: another process may remove its own folder at any moment
        except OSError:
            continue
        if found.st_uid == os.getuid() and stat.S_ISDIR(found.st_mode) and process_gone(int(driver)):
            shutil.rmtree(path, ignore_errors=True)


# --- a full disk, named ----------------------------------------------------------------------


def free_space(path: str) -> tuple[int, int]:
    """(bytes, inodes) that this user can still use on the disk holding ``path`` (root may use the
    blocks reserved for it)."""
    found = os.statvfs(path)
    blocks = found.f_bfree if os.geteuid() == 0 else found.f_bavail
    return blocks * found.f_frsize, found.f_favail


def disk_problem(path: str | None = None) -> str | None:
    """What is wrong with the disk of the World's folder ``path`` (the temporary folder by default)
    if it is too full to write to: a sentence naming the folder, what is free and the fix."""
    root = tempfile.gettempdir()
    try:
        free, inodes = free_space(path or root)
    except OSError:
        return None
    if free >= LOW_DISK_BYTES and inodes != 0:
        return None
    what = f"{free} bytes free" if free < LOW_DISK_BYTES else "no free inodes"
    return (f"{_named(root)} has {what}: a World writes its rendezvous file, its ranks' stacks and "
            "multiprocessing's socket there. Fix: free space on that disk, or set TMPDIR to a folder on a "
            "disk with room.")


def _named(root: str) -> str:
    """How the user knows the temporary folder: by TMPDIR if that is where it comes from."""
    chosen = os.environ.get("TMPDIR")
    if chosen and os.path.realpath(chosen) == os.path.realpath(root):
        return f"TMPDIR={chosen}"
    return f"the temporary folder {root}" + ("" if chosen else " (TMPDIR is not set)")


def _cannot_write(error: OSError) -> str:
    root = tempfile.gettempdir()
    problem = disk_problem(root)
    if problem is not None:
        return f"Could not start a World: {problem}"
    return (f"Could not start a World: its folder cannot be made in {_named(root)} ({error}). Fix: make that "
            "folder writable, or set TMPDIR to one that is.")
