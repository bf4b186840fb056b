"""Scripts as a user writes them, run as ``python script.py``: what they print on stderr, how they end.

A script that starts workers at module level (no main guard) gets one short pipecheck message with
the two-line fix; a script that uses a World, even through faults, leaves no warning on stderr (no
torch-internal warning, no leaked semaphore) and no process behind.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck._world import spawn as _world_spawn
from pipecheck._world.spawn import UNGUARDED_MAIN_EXIT, refuse_unguarded_main
from pipecheck.errors import WorldStartError

HEADER = '''
import torch
import torch.nn as nn
import pipecheck as pc


def make_model():
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))


def fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return ctx.rank


x = torch.randn(4, 4)
'''

UNGUARDED = {
    "assert_equivalent": "pc.assert_equivalent(make_model, (x,), runner='distributed')\n",
    "World and run_pipeline": "with pc.World(1) as world:\n    pc.run_pipeline(world, make_model, (x,))\n",
    "strategies": textwrap.dedent('''
        from pipecheck.strategies import InputSpec, LayerSpec, ModelSpec, OutputSpec, PipelineCase
        spec = ModelSpec((InputSpec("x", "x", 2),), (LayerSpec("linear", (-1,), 2),), OutputSpec("single", (0,)),
                         batch=4, seed=0)
        PipelineCase(spec, {}, n_microbatches=1).check("distributed")
    '''),
}


def run_script(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run ``HEADER + body`` as a script; return the result and the pids of its processes still alive."""
    script = tmp_path / "script.py"
    script.write_text(HEADER + body)
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPECHECK_SCRIPT_MARK": mark}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    deadline = time.monotonic() + 10
    while (left := _marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)  # the resource tracker exits a moment after its driver
    return result, left


def _marked_processes(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"PIPECHECK_SCRIPT_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # gone, or not ours
    return found


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")


@needs_proc
@pytest.mark.parametrize("body", list(UNGUARDED.values()), ids=list(UNGUARDED))
def test_a_missing_main_guard_is_one_short_message_with_the_fix(body: str, tmp_path: Path) -> None:
    result, left = run_script(tmp_path, body)
    assert result.returncode == 1
    stderr = result.stderr
    assert stderr.count("Traceback") == 1 and "bootstrapping phase" not in stderr, stderr
    assert len(stderr.splitlines()) <= 40, stderr
    assert "WorldStartError: this script starts pipecheck's worker processes at module level" in stderr
    assert stderr.rstrip().endswith('Fix: put the script\'s work under a main guard:\n'
                                     '    if __name__ == "__main__":\n'
                                     '        main()'), stderr
    assert left == []


@needs_proc
def test_a_script_using_a_world_through_faults_leaves_no_warning_and_no_process(tmp_path: Path) -> None:
    body = textwrap.dedent('''
        def rank_of(ctx):
            return ctx.rank


        if __name__ == "__main__":
            spec = {"2": pc.SplitPoint.BEGINNING}
            world = pc.World.shared(2)  # the World the checks below run on when given none
            for runner in ("distributed", "torch"):
                print(pc.assert_equivalent(make_model, (x,), split_spec=spec, n_microbatches=2,
                                           runner=runner).headline())
            try:
                world.run(fail_on_rank_1)  # its ranks are stopped, then started again for the next task
            except pc.WorldError as error:
                print("failed:", type(error).__name__)
            print("then:", world.run(rank_of))
            pc.World.close_shared()
    ''')
    result, left = run_script(tmp_path, body)
    assert result.returncode == 0, result.stderr
    # nothing but the script's own lines: torch 2.10's gloo prints a line as each rank connects, a few bytes at
    # a time, and the ranks share the script's stdout (pipecheck makes its groups with fd 1 on /dev/null)
    assert "[Gloo]" not in result.stdout and "peer ranks" not in result.stdout, result.stdout
    assert result.stdout.splitlines()[-2:] == ["failed: RankFailedError", "then: [0, 1]"]
    assert "runner 'distributed' matches eager" in result.stdout
    assert "runner 'torch' matches eager" in result.stdout
    assert result.stderr == ""  # no torch warning, no resource_tracker "leaked semaphore"
    assert left == []


@needs_proc
def test_the_ranks_forkserver_ends_before_the_script_does(tmp_path: Path) -> None:
    """Not the second or two after it that it would take to notice the script has gone and tear torch down;
    and only after multiprocessing has stopped the script's own children started from the same forkserver."""
    body = textwrap.dedent('''
        import multiprocessing.forkserver
        import time

        if __name__ == "__main__":
            with pc.World(2) as world:
                world.run(print)
            mine = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,), daemon=True)
            mine.start()  # the user's own, from the forkserver pipecheck started: multiprocessing stops it at exit
            print("PIDS", mine.pid, multiprocessing.forkserver._forkserver._forkserver_pid)
    ''')
    script = tmp_path / "script.py"
    script.write_text(HEADER + body)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    found = re.search(r"^PIDS (\d+) (\d+)$", result.stdout, re.MULTILINE)
    assert found, result.stdout
    daemon, forkserver = int(found[1]), int(found[2])
    assert not Path(f"/proc/{forkserver}").exists()  # checked at once: gone (and reaped) with the script
    assert not Path(f"/proc/{daemon}").exists()  # stopped by multiprocessing, which the forkserver's stop follows


# --- in this process --------------------------------------------------------------------------------


def test_a_rank_importing_an_unguarded_script_exits_quietly_and_another_child_raises(monkeypatch) -> None:
    process = multiprocessing.current_process()
    monkeypatch.setattr(process, "_inheriting", True, raising=False)  # as spawn sets it while importing main
    with pytest.raises(WorldStartError, match="outside a main guard"):
        refuse_unguarded_main()  # a child of the user's own
    monkeypatch.setattr(process, "name", "pipecheck-rank1")

    def exit_now(status: int) -> None:  # os._exit, here raising instead of ending the test process
        raise SystemExit(status)

    monkeypatch.setattr(_world_spawn, "_exit_now", exit_now)
    with pytest.raises(SystemExit) as info:
        refuse_unguarded_main()  # one of pipecheck's ranks: its driver reports it, once
    assert info.value.code == UNGUARDED_MAIN_EXIT


def test_outside_a_spawned_import_nothing_is_refused() -> None:
    refuse_unguarded_main()


class KeepsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x * 2  # a tensor attribute set in forward: torch.export warns when it traces this
        return self.b(self.a(x))


def test_the_export_tracer_keeps_torch_s_internal_warnings_to_itself() -> None:
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        torch.export.export(KeepsLast(), (torch.randn(4, 4),))
    assert any("assigned during export" in str(w.message) for w in direct)  # so the check below means something
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pc.assert_equivalent(KeepsLast, (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING},
                             tracer="export", runner="reference", n_microbatches=2)
    assert [str(w.message) for w in seen] == []
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)
    assert len(after) == 1  # nothing filtered outside pipecheck's calls


def test_a_script_read_from_standard_input_is_told_to_become_a_file(tmp_path: Path) -> None:
    """Ranks import the main script again by path; `python - < script.py` has none. One message,
    raised in the driver before any rank starts (never multiprocessing's traceback from each rank)."""
    body = HEADER + 'if __name__ == "__main__":\n    pc.assert_equivalent(make_model, (x,), runner="distributed")\n'
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-"], input=body, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "WorldStartError: the main script is '<stdin>', not a file" in result.stderr
    assert "Fix: save the script to a file" in result.stderr
    assert "multiprocessing" not in result.stderr, result.stderr
