"""A World's start against a process that takes a peer's place on a rank's gloo port: refused and named
at start, never a start that "succeeds" and a first task that hangs; a layout's size authenticated
before anything is allocated.

The intruder here runs as the same user (a test cannot switch users); it does what another user can
do on this host: connect to the ranks' loopback ports as they appear and write gloo's sequence bytes.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipecheck._world.handshake import _socket_inodes
from pipecheck._world.world import World
from pipecheck.errors import WorldStartError

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
import _world_jobs as jobs  # noqa: E402

LINUX = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="finds the ranks' ports in /proc/net/tcp")


def _listening_ports(pids: tuple[int, ...]) -> set[int]:
    inodes: set[str] = set()
    for pid in pids:
        try:
            inodes |= _socket_inodes(pid)
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].split(":")[1], 16))
    return ports


class Intruder(threading.Thread):
    """Connects to every port the World's ranks listen on and writes gloo's sequence numbers 0..7, one
    connection each. It holds the World's store locked while it looks (flock, as FileStore takes it), so
    that a rank which has opened its port cannot publish it to its peer first: the race is won every time."""

    def __init__(self, world: World) -> None:
        super().__init__(daemon=True)
        self.world, self.done = world, threading.Event()
        self.sockets: list[socket.socket] = []
        self.seen: set[int] = set()

    def run(self) -> None:
        ranks = self.world._ranks
        while not self.done.is_set() and getattr(ranks, "tmpdir", None) is None:
            time.sleep(0.001)
        if self.done.is_set():
            return
        store = os.open(os.path.join(ranks.tmpdir, "filestore"), os.O_RDWR | os.O_CREAT, 0o600)  # type: ignore[union-attr, arg-type]
        try:
            while not self.done.is_set():
                fcntl.flock(store, fcntl.LOCK_EX)
                try:
                    time.sleep(0.02)
                    for port in _listening_ports(self.world.pids) - self.seen:
                        self.seen.add(port)
                        for sequence in range(8):
                            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
                            connection.sendall(struct.pack("<q", sequence))
                            self.sockets.append(connection)
                finally:
                    fcntl.flock(store, fcntl.LOCK_UN)
                time.sleep(0.001)
        finally:
            os.close(store)

    def close(self) -> None:
        self.done.set()
        self.join(10)
        for connection in self.sockets:
            connection.close()


@LINUX
def test_a_process_that_takes_a_peer_s_place_at_start_is_refused_and_named() -> None:
    world = World(2, start_timeout=60, timeout=30)
    intruder = Intruder(world)
    intruder.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorldStartError) as refused:
            world.__enter__()  # before the handshake: started, and the first task hung for its timeout
        pids = world.pids
    finally:
        intruder.close()
        world.close()
    message = str(refused.value)
    assert intruder.seen, "the intruder never saw a rank's port"
    assert "the connections between its ranks did not all reach this World's ranks" in message
    assert "rank 0, its connection with rank 1: no answer within" in message
    assert "rank 1, its connection with rank 0: no answer within" in message
    assert "Held by a process outside the World: " in message
    assert f"pid {os.getpid()} (" in message  # this test's process holds them
    assert "Fix: find that process" in message and "send/recv" not in message
    assert pids == () and time.monotonic() - started < 55  # the ranks are stopped; no start_timeout waited


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(2, timeout=60) as two:
        yield two


def test_a_peer_without_the_world_s_key_is_named_by_both_ranks(world: World) -> None:
    assert world.run(jobs.prove_peers_with, wrong_key_on=1) == [
        ("its connection with rank 1: what came over it does not carry this World's key",),
        ("its connection with rank 0: what came over it does not carry this World's key",),
    ]
    assert world.run(jobs.prove_peers_with, wrong_key_on=-1) == [(), ()]  # both keyed: proven


def test_a_peer_that_never_answers_is_named() -> None:
    with World(2, timeout=60) as silent:  # the timed-out pair closes: a World of its own
        assert silent.run(jobs.prove_peers_with, wrong_key_on=-1, silent=1) == [
            ("its connection with rank 1: no answer within 2 s",), ()]


@pytest.mark.parametrize(
    ("size", "keyed", "key", "said"),
    [
        pytest.param(-5, False, None, "layout's size of value", id="negative-unsigned"),
        pytest.param(2**42, False, None, "layout's size of value", id="huge-unsigned"),
        pytest.param(-5, True, None, "claims -5 bytes", id="negative-signed"),
        pytest.param(2**42, True, None, f"claims {2**42} bytes", id="huge-signed"),
        pytest.param(-5, True, b"", "claims -5 bytes", id="negative-no-key"),  # torchrun: no World key
    ],
)
def test_a_forged_layout_size_is_refused_before_anything_is_allocated(
    world: World, size: int, keyed: bool, key: bytes | None, said: str
) -> None:
    sent, refused = world.run(jobs.receive_forged_layout_size, size, keyed, key)
    assert sent == "sent" and said in refused, refused
    if not keyed:
        assert "failed authentication: it was not sent by a rank of this World, and was not used" in refused
    else:
        assert "nothing was allocated" in refused
