"""pipecheck under torchrun: ``World.from_env()`` on every rank, ``assert_equivalent`` over all of them.

Two torchrun agents on this machine play two nodes (c10d rendezvous on localhost, 2 processes each):
the 4 ranks check a tied weight whose gradients are all-reduced across the nodes and a skip connection
under the zero-bubble schedule (marked slow: ``pytest -m slow tests/world/test_torchrun.py``, and the nightly
nox session). By default one agent with 2 processes checks the V-placed "zbv" schedule. Every
agent runs in its own session with its output in a file; whatever the outcome, both agents' process
groups and every rank (torchrun starts each rank in a session of its own) are killed by process id.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "_torchrun_check.py"
# A port taken between choosing it and the agent binding it, or a rendezvous that missed its peer.
RETRYABLE = re.compile(r"EADDRINUSE|Address already in use|RendezvousConnectionError|RendezvousTimeoutError")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to clean up ranks")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pids_tagged(tag: str) -> list[int]:
    """Processes whose command line holds ``tag`` (one launch's agents and ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # exited meanwhile
    return found


def _stop(agents: list[subprocess.Popen[bytes]], tag: str) -> None:
    """SIGTERM each agent's process group (torchrun passes it on to its ranks), then SIGKILL what is left:
    the groups, and every rank still running (each in a session of its own), by process id."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for agent in agents:
        try:
            agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for agent in agents:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        agent.wait()
    for pid in _pids_tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Launch:
    codes: list[int | None]  # None: still running at the deadline
    logs: list[str]
    seconds: float

    @property
    def text(self) -> str:
        return "\n".join(self.logs)


def launch(tmp: Path, nnodes: int, checks: list[str], timeout: float = 150.0) -> Launch:
    """``nnodes`` torchrun agents of 2 ranks each on localhost; retried when the rendezvous port was taken."""
    for attempt in range(3):
        result = _launch_once(tmp / f"attempt{attempt}", nnodes, checks, timeout)
        if result.codes == [0] * nnodes or None in result.codes or not RETRYABLE.search(result.text):
            return result
    return result


def _launch_once(folder: Path, nnodes: int, checks: list[str], timeout: float) -> Launch:
    folder.mkdir(parents=True)
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    tag = f"--pipecheck-test-{run_id}"  # on every process's command line, to find the ranks afterwards
    # TMPDIR: torchrun's agents write torchelastic_* folders there, not in /tmp
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(folder))
    agents: list[subprocess.Popen[bytes]] = []
    logs = [folder / f"node{node}.log" for node in range(nnodes)]
    started = time.monotonic()
    try:
        for node, log in enumerate(logs):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                       "--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
                       # node 0's agent hosts the rendezvous store (c10d ignores --node-rank)
                       "--rdzv-conf", f"join_timeout=60,is_host={int(node == 0)}",
                       str(SCRIPT), *checks, tag]
            with log.open("w") as out:
                agents.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                               cwd=folder, start_new_session=True))
        codes: list[int | None] = []
        for agent in agents:
            try:
                codes.append(agent.wait(timeout=max(0.1, started + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        _stop(agents, tag)
    assert _pids_tagged(tag) == [], "a rank outlived its launch"
    return Launch(codes, [log.read_text() for log in logs], time.monotonic() - started)


def _statuses(text: str) -> list[tuple[int, str, str]]:
    # not anchored to a line: a rank's line is one write, but it may land inside rank 0's report
    return sorted((int(r), check, status) for r, check, status in re.findall(r"RANK (\d+) (\S+) (MATCH|MISMATCH)\b",
                                                                              text))


@pytest.mark.slow  # 28 s alone, 55 s inside `pytest -n auto` on 2 cores; the one-node test below runs by default
def test_assert_equivalent_across_two_torchrun_nodes(tmp_path: Path) -> None:
    checks = ["tiny_gpt:1f1b", "long_skip:zb"]
    result = launch(tmp_path, nnodes=2, checks=checks)
    assert result.codes == [0, 0], result.text[-4000:]
    assert _statuses(result.text) == sorted((rank, check, "MATCH") for rank in range(4) for check in checks)
    # global rank 0 (on whichever agent c10d made it) printed both reports, once each
    assert result.text.count("matches eager") == 2, result.text[-4000:]
    assert "4 stages" in result.text


def test_assert_equivalent_under_torchrun_on_one_node(tmp_path: Path) -> None:
    result = launch(tmp_path, nnodes=1, checks=["mlp:zbv:2"])
    assert result.codes == [0], result.text[-4000:]
    assert _statuses(result.text) == [(0, "mlp:zbv:2", "MATCH"), (1, "mlp:zbv:2", "MATCH")]
