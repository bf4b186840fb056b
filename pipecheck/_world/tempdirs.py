"""The World's temporary folders: one per World, this user's own, swept when their driver is gone.

    tmpdir = make_tmpdir()          # $TMPDIR/pipecheck-world-<driver pid>-<random>, mode 0700
    sweep_stale_tmpdirs()           # this user's folders whose driver was killed (no close() ran)
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from pipecheck._world.worker import process_gone

TMPDIR_PREFIX = "pipecheck-world-"  # then the driver's pid: pipecheck-world-1234-abcd


def make_tmpdir() -> str:
    """A new folder for one World (its file store, its ranks' stack dumps); only this user can enter it."""
    return tempfile.mkdtemp(prefix=f"{TMPDIR_PREFIX}{os.getpid()}-")  # mkdtemp: mode 0700


def sweep_stale_tmpdirs() -> None:
    """Remove this user's temporary directories of worlds whose driver was killed (no close() ran).

    Another user's directories, and names that only look like ours, are never touched and never
    raise: anyone can create ``pipecheck-world-99999999999999999999-x`` in a shared temp folder.
    """
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        driver = name[len(TMPDIR_PREFIX) :].split("-", 1)[0]
        if not (name.startswith(TMPDIR_PREFIX) and driver.isdigit() and len(driver) <= 10):
            continue
        path = os.path.join(root, name)
        try:
            found = os.lstat(path)  # once: another process may remove its own folder at any moment
        except OSError:
            continue
        if found.st_uid == os.getuid() and stat.S_ISDIR(found.st_mode) and process_gone(int(driver)):
            shutil.rmtree(path, ignore_errors=True)
