"""Proof, as a World starts, that every rank's connections reach its true peers.

    problems = prove_peers(rank, world_size, secret, timeout_s=10)  # () when every peer answered
    if problems:
        ...  # the rank refuses to join; the driver names what took the connections

gloo connects a pair of ranks over plain TCP: one rank listens, and its port hands the pair to
the first connection that writes the expected sequence number, whoever makes it. Any local user
can connect to a loopback port and guess that number, so a process outside the World can take
the place of a peer. The rendezvous itself cannot be reached (a FileStore in a folder only this
user can enter) and the World's key never leaves its processes (it travels in the pickled config
over a pipe). So, right after the process group forms, every rank sends every other rank a tag
made with the key for that direction (``HMAC(key, "i->j")``) and checks the one it receives: a
connection held by another process cannot answer (it never sees its peer's tag, and a tag for one
direction is no use in another), and the start fails naming it instead of a later task hanging.

The limit: a taken connection is found and refused at start, not prevented (gloo has no
authentication of its own); process groups a task creates later (``dist.new_group``) are not
proven; NCCL's connections are not (NCCL checks a random magic of its own on its bootstrap).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pwd
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HANDSHAKE_TAG = 0x7069_7063  # "pipc": no task runs yet, so no tag can collide with it
TAG_BYTES = 32


def peer_tag(secret: bytes, sender: int, receiver: int) -> bytes:
    """What ``sender`` proves itself with to ``receiver``: only the World's processes can make it."""
    return hmac.new(secret, b"pipecheck-peer %d->%d" % (sender, receiver), hashlib.sha256).digest()


def prove_peers(rank: int, world_size: int, secret: bytes, timeout_s: float) -> tuple[str, ...]:
    """Exchange tags with every other rank over the default group; one line per peer that failed."""
    peers = [peer for peer in range(world_size) if peer != rank]
    received = {peer: torch.zeros(TAG_BYTES, dtype=torch.uint8) for peer in peers}
    recvs = {peer: dist.irecv(received[peer], peer, tag=HANDSHAKE_TAG) for peer in peers}
    sends = {}
    for peer in peers:
        tag = torch.frombuffer(bytearray(peer_tag(secret, rank, peer)), dtype=torch.uint8)
        sends[peer] = dist.isend(tag, peer, tag=HANDSHAKE_TAG)
    deadline = time.monotonic() + timeout_s
    problems = []
    for peer in peers:
        problem = _wait(recvs[peer], deadline, timeout_s) or _wait(sends[peer], deadline, timeout_s)
        if problem is None and not hmac.compare_digest(bytes(received[peer].tolist()), peer_tag(secret, peer, rank)):
            problem = "what came over it does not carry this World's key"
        if problem is not None:
            problems.append(f"its connection with rank {peer}: {problem}")
    return tuple(problems)


def _wait(work: dist.Work | None, deadline: float, timeout_s: float) -> str | None:
    assert work is not None  # isend/irecv return None only to a rank outside the group
    left = max(0.001, deadline - time.monotonic())
    try:
        work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as error:  # gloo: a timeout, or the pair closed or garbled
        if "Timed out" in str(error):
            return f"no answer within {timeout_s:g} s"
        return f"it failed ({error})"
    return None


# --- who holds a rank's connections (Linux: /proc/net/tcp) -------------------------------------


def foreign_connections(pid: int | None = None) -> tuple[tuple[str, str], ...]:
    """The TCP connections of process ``pid`` (this one by default) whose other end is a process
    that is no sibling of it (the World's ranks share a parent: the forkserver or the driver), as
    ("127.0.0.1:PORT", "pid P (command), uid U (name)"). Empty where /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    try:
        entries = _tcp_entries()
        own = _socket_inodes(pid)
        parent = _parent_of(pid)
    except OSError:
        return ()
    by_local = {(local, remote): (uid, inode) for local, remote, uid, inode in entries}
    found = []
    for local, remote, _, inode in entries:
        if inode not in own or (remote, local) not in by_local:
            continue
        uid, their_inode = by_local[(remote, local)]
        holder = _holder(their_inode, uid)
        if holder is not None and _parent_of_quietly(holder) == parent:
            continue  # a rank of the same World
        who = f"uid {uid} ({_user(uid)})"
        found.append((_address(remote), f"pid {holder} ({_command(holder)}), {who}" if holder is not None else who))
    return tuple(found)


def _tcp_entries() -> list[tuple[str, str, int, str]]:
    """(local, remote, uid, inode) of every established TCP socket this network namespace holds."""
    entries = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] == "01":  # ESTABLISHED
                        entries.append((fields[1], fields[2], int(fields[7]), fields[9]))
        except FileNotFoundError:
            continue
    return entries


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _holder(inode: str, uid: int) -> int | None:
    """The process holding socket ``inode``, if it is one whose folders this user may read."""
    if uid != os.getuid() and os.getuid() != 0:
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if inode in _socket_inodes(int(entry)):
                    return int(entry)
            except OSError:
                continue
    return None


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rpartition(b")")[2].split()[1])


def _parent_of_quietly(pid: int) -> int | None:
    try:
        return _parent_of(pid)
    except (OSError, ValueError, IndexError):
        return None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"
    except OSError:
        return "?"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OSError):
        return "no such user"


def _address(hex_address: str) -> str:
    """/proc/net/tcp's "0100007F:9C40" as "127.0.0.1:40000" (IPv6 addresses stay in hex)."""
    host, port = hex_address.split(":")
    if len(host) == 8:
        host = ".".join(str(b) for b in reversed(bytes.fromhex(host)))
    return f"{host}:{int(port, 16)}"
