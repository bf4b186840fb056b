"""Tests of pipecheck._world.world: running jobs on every rank, faults, restarts, cleanup."""

from __future__ import annotations

import os
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
import torch

from pipecheck._world.tempdirs import TMPDIR_PREFIX, sweep_stale_tmpdirs
from pipecheck._world.world import World
from pipecheck.errors import (
    RankDiedError,
    RankFailedError,
    RankTimeoutError,
    TaskPickleError,
    WorldError,
    WorldStartError,
)

# Spawned ranks unpickle jobs by module name; they inherit this sys.path, so
# `_world_jobs` imports there too, whatever pytest's import mode.
TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
import _world_jobs as jobs  # noqa: E402

REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(2, timeout=60, start_timeout=60) as shared:
        yield shared


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_until_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


# --- running jobs -----------------------------------------------------------


def test_run_returns_each_ranks_value_in_rank_order(world: World) -> None:
    assert world.run(jobs.describe_rank) == [
        {
            "rank": r,
            "world_size": 2,
            "device": "cpu",
            "comm_device": "cpu",
            "backend": "gloo",
            "initialized": True,
        }
        for r in range(2)
    ]


def test_args_and_kwargs_reach_every_rank(world: World) -> None:
    assert world.run(jobs.echo, 1, "two", three=[3]) == [
        (0, (1, "two"), {"three": [3]}),
        (1, (1, "two"), {"three": [3]}),
    ]


def test_all_reduce_sums_over_ranks(world: World) -> None:
    assert world.run(jobs.all_reduce_rank) == [[3.0, 3.0, 3.0]] * 2


def test_properties_describe_the_placement(world: World) -> None:
    props = world.properties
    assert (props.world_size, props.device, props.backend) == (2, "cpu", "gloo")
    assert props.devices == ("cpu", "cpu") and props.comm_devices == ("cpu", "cpu")
    assert (props.gpus_shared, props.launcher) == (False, "spawn")
    assert (world.world_size, world.device) == (2, "cpu")
    assert repr(world) == "World(2, device='cpu', timeout=60, start_timeout=60)"
    assert world.run(jobs.placement) == [props.devices] * 2  # every rank knows where its peers compute


# --- faults: each is reported, then the next task on the same World passes ---


def test_rank_that_raises_names_rank_stage_and_traceback(world: World) -> None:
    with pytest.raises(RankFailedError) as caught:
        world.run(jobs.raise_on_rank, 1)
    error = caught.value
    assert (error.rank, error.stage) == (1, 3)
    assert (error.error.exc_type, error.error.message, error.error.action) == ("ValueError", "boom on rank 1", "1B0")
    message = str(error)
    assert message.startswith(
        "rank 1 of 2 raised ValueError: boom on rank 1 while running stage 3 (action '1B0') "
        "of task _world_jobs.raise_on_rank."
    )
    assert 'in raise_on_rank\n        raise ValueError(f"boom on rank {ctx.rank}")' in message
    assert "Still running when stopped: rank(s) 0 (probably waiting for rank 1)." in message
    # A collective after the restart proves the new process group works.
    assert world.run(jobs.all_reduce_rank) == [[3.0, 3.0, 3.0]] * 2


def test_rank_that_hangs_times_out_with_every_ranks_stack(world: World) -> None:
    started = time.monotonic()
    with pytest.raises(RankTimeoutError) as caught:
        world.run(jobs.hang_on_rank, 1, timeout=5)  # rank 0 finishes well within it, on a busy machine too
    assert time.monotonic() - started < 5 + 25  # stacks, then stopping the ranks: not the World's 60 s
    error = caught.value
    assert error.ranks == (1,)
    message = str(error)
    assert error.hung == 1
    assert message.startswith(
        "task _world_jobs.hang_on_rank did not finish within 5 s: rank 1 of 2 hung, in stage 2 (action '2F0').\n"
        "Python stack of rank 1, where it hung:\n"
    )
    assert message.index("in sleep_forever") < message.index("--- rank 0 (finished) ---")  # its stack first
    assert "rank 0: finished\nrank 1: still running, stage 2 (action '2F0')" in message
    assert "in sleep_forever" in error.stacks[1] and "in hang_on_rank" in error.stacks[1]
    assert "in worker_main" in error.stacks[0]  # the idle rank's stack is there too
    assert "_exit_when_orphaned" not in message  # the watchdog thread is left out
    assert world.run(jobs.all_reduce_rank) == [[3.0, 3.0, 3.0]] * 2


@pytest.mark.parametrize(
    ("how", "exitcode", "expected"),
    [
        ("exit", 3, "it exited with code 3"),
        ("sigkill", -signal.SIGKILL, "it was killed by SIGKILL (exit code -9)"),
        ("segfault", -signal.SIGSEGV, "it was killed by SIGSEGV (exit code -11)"),
    ],
    ids=["os._exit", "SIGKILL", "segfault"],
)
def test_rank_that_dies_is_reported_promptly(
    world: World, how: str, exitcode: int, expected: str
) -> None:
    started = time.monotonic()
    with pytest.raises(RankDiedError) as caught:
        world.run(jobs.die_on_rank, 1, how, timeout=60)
    assert time.monotonic() - started < 30  # not the 60 s timeout
    error = caught.value
    assert (error.rank, error.exitcode, error.stage) == (1, exitcode, 1)
    assert str(error).startswith(
        f"rank 1 of 2 died while running stage 1 of task _world_jobs.die_on_rank: {expected}"
    )
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in str(error)
        assert "in die_on_rank" in str(error)
    assert world.run(jobs.all_reduce_rank) == [[3.0, 3.0, 3.0]] * 2


def test_unpicklable_return_value_is_a_rank_failure(world: World) -> None:
    with pytest.raises(RankFailedError, match="cannot be pickled back to the driver"):
        world.run(jobs.return_unpicklable)
    assert world.run(jobs.echo) == [(0, (), {}), (1, (), {})]


@pytest.mark.parametrize(
    ("fn", "args", "what"),
    [
        (lambda ctx: 0, (), "fn"),
        (jobs.echo, (lambda: 0,), r"args\[0\]"),
    ],
    ids=["lambda-fn", "lambda-arg"],
)
def test_unpicklable_job_is_refused_with_the_fix(
    world: World, fn: object, args: tuple[object, ...], what: str
) -> None:
    with pytest.raises(
        TaskPickleError, match=f"World.run\\(\\): {what} cannot be pickled.*move fn to module level"
    ):
        world.run(fn, *args)


# --- arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1 (got 0)"),
        ({"world_size": True}, "world_size must be an int >= 1 (got True)"),
        ({"world_size": 2, "device": "tpu"}, "device must be 'cpu' or 'cuda' (got 'tpu')"),
        ({"world_size": 2, "timeout": 0}, "timeout must be a number of seconds > 0 (got 0)"),
        (
            {"world_size": 2, "start_timeout": -1},
            "start_timeout must be a number of seconds > 0 (got -1)",
        ),
        (
            {"world_size": 0, "device": "tpu"},
            "world_size must be an int >= 1 (got 0); device must be 'cpu' or 'cuda' (got 'tpu')",
        ),
    ],
    ids=[
        "zero-ranks",
        "bool-ranks",
        "unknown-device",
        "zero-timeout",
        "negative-start-timeout",
        "two-problems",
    ],
)
def test_invalid_arguments_are_reported_together(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(
        WorldError, match="^World: " + message.replace("(", r"\(").replace(")", r"\)") + r"\.$"
    ):
        World(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpus_suggests_cpu() -> None:
    with pytest.raises(WorldError, match=r"needs CUDA.*Use World\(\.\.\., device='cpu'\)"):
        World(2, device="cuda")


def test_from_env_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        WorldError, match="missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"
    ):
        World.from_env()


# --- lifetime ----------------------------------------------------------------


def test_two_worlds_at_once_and_close_leaves_no_process(world: World) -> None:
    with World(2, timeout=60) as other:
        # Both rendezvous at the same time: private FileStores never collide.
        assert other.run(jobs.all_reduce_rank) == world.run(jobs.all_reduce_rank)
        pids = other.run(jobs.pid)
        assert list(other.pids) == pids
        tmpdir = other._ranks.tmpdir  # type: ignore[union-attr]
    assert _wait_until_gone(pids, within=1) == []
    assert tmpdir is not None and not os.path.exists(tmpdir)
    with pytest.raises(WorldError, match="is closed; create a new World"):
        other.run(jobs.pid)


def test_rank_that_cannot_join_gives_a_start_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    broken = World(2, start_timeout=60)
    with pytest.raises(
        WorldStartError,
        match=r"(?s)Could not start World\(2, device='cpu'\).*rank \d failed to join the world.*GLOO_SOCKET_IFNAME",
    ):
        broken.run(jobs.pid)
    broken.close()


def test_killed_drivers_tmpdirs_are_swept_by_the_next_world() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(finished.stdout)
    stale = tempfile.mkdtemp(prefix=f"{TMPDIR_PREFIX}{dead_pid}-")
    mine = tempfile.mkdtemp(prefix=f"{TMPDIR_PREFIX}{os.getpid()}-")
    try:
        sweep_stale_tmpdirs()
        assert (os.path.exists(stale), os.path.exists(mine)) == (False, True)
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(mine, ignore_errors=True)


DRIVER_SCRIPT = """
import os, sys, threading, time
import _world_jobs as jobs
from pipecheck._world.world import World
from pipecheck._world.tempdirs import TMPDIR_PREFIX, sweep_stale_tmpdirs

def start(holder):
    holder["world"] = World(2, timeout=60, start_timeout=60)
    holder["pids"] = holder["world"].run(jobs.pid)

if __name__ == "__main__":
    holder = {}
    if sys.argv[1] == "thread":  # no PR_SET_PDEATHSIG then: the watchdog thread must act
        starter = threading.Thread(target=start, args=(holder,))
        starter.start()
        starter.join()
    else:
        start(holder)
    os.write(1, f"pids: {' '.join(map(str, holder['pids']))}\\n".encode())  # one write: a rank's can't split it
    holder["world"].run(jobs.sleep, 600, timeout=900)  # killed mid-job: ranks are busy
"""


@pytest.mark.parametrize("started_from", ["main-thread", "thread"])
def test_killed_driver_leaves_no_orphan_ranks(tmp_path: Path, started_from: str) -> None:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
    driver = subprocess.Popen(
        [sys.executable, str(script), started_from], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert driver.stdout is not None
        # gloo itself prints "[Gloo] Rank 0 is connected to ..." lines on some torch releases (2.8, 2.9)
        line = next(line for line in driver.stdout if line.startswith("pids:"))
        pids = [int(pid) for pid in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        time.sleep(0.5)  # let the ranks enter the sleeping job
    finally:
        driver.kill()
        driver.wait()
    assert _wait_until_gone(pids, within=30) == []  # the ranks' watchdog polls every 0.5 s; 2 cores are busy


TORCHRUN_SCRIPT = """
import os
from pipecheck.errors import RankFailedError
from pipecheck._world.world import World
from pipecheck._world.tempdirs import TMPDIR_PREFIX, sweep_stale_tmpdirs
import _world_jobs as jobs

world = World.from_env(timeout=60)
sums = world.run(jobs.all_reduce_rank)
try:
    world.run(jobs.raise_without_collective, 1)
except RankFailedError as error:
    failed = (error.rank, error.stage)
ranks = world.run(jobs.describe_rank)
line = f"rank {ranks[0]['rank']}/{world.world_size} {world.properties.devices} {sums} {failed}\\n"
os.write(1, line.encode())  # one write: the two ranks share stdout, print() writes in pieces
world.close()
"""


def test_from_env_under_torchrun_runs_locally_and_gathers(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0/2 ('cpu', 'cpu') [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]] (1, 4)"] * 2


def test_job_the_ranks_cannot_import_is_reported_with_the_fix(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.run(jobs.echo)  # ranks already running: they do not see sys.path changes made now
    (tmp_path / "late_module.py").write_text("def job(ctx):\n    return ctx.rank\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import late_module  # type: ignore[import-not-found]

    with pytest.raises(RankFailedError, match="(?s)ModuleNotFoundError.*could not be unpickled"):
        world.run(late_module.job)
    assert world.run(late_module.job) == [0, 1]  # fresh ranks inherit the new sys.path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra_ranks", [0, 1], ids=["one-gpu-per-rank", "ranks-share-gpus"])
def test_cuda_world_computes_on_gpus_and_communicates(extra_ranks: int) -> None:
    n = torch.cuda.device_count() + extra_ranks
    with World(n, device="cuda", timeout=120) as gpus:
        props = gpus.properties
        assert props.devices == tuple(f"cuda:{r % torch.cuda.device_count()}" for r in range(n))
        assert (props.backend, props.gpus_shared) == (
            ("gloo", True) if extra_ranks else ("nccl", False)
        )
        total = float(sum(2 * (r + 1) for r in range(n)))
        assert gpus.run(jobs.placement) == [props.devices] * n  # whom each rank may pass tensors to on its GPU
        assert gpus.run(jobs.all_reduce_on_device) == [
            (props.devices[r], props.comm_devices[r], [total] * 3) for r in range(n)
        ]
