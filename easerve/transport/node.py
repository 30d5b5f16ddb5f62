"""Where a process lives, told from facts rather than names.

A stage's address says nothing about which transports reach it: compose service names
differ from container hostnames, two containers of one host may or may not share
/dev/shm, and "localhost" in a pod is not the node. So every stage process publishes a
`NodeIdentity` (through `easerve.v1.Stage/Load`):

- `host_id`: the kernel's boot id. Equal on one host, containers included.
- `shm_probe` / `shm_token`: a small POSIX shared-memory segment the process created at
  start, holding random bytes. A peer that can open it *and* reads the same bytes shares
  this process's /dev/shm, so shared-memory KV handoff really works between them.
- `device`: where its tensors are ("cpu", "cuda:0").

`Reach` is what one process concludes about another from the two identities.
"""
from __future__ import annotations

import atexit
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker

import _posixshmem

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_TOKEN_BYTES = 16


@dataclass(frozen=True)
class NodeIdentity:
    host_id: str
    shm_probe: str = ""
    shm_token: str = ""
    device: str = "cpu"

    def to_proto(self, msg) -> None:
        msg.host_id, msg.shm_probe, msg.shm_token, msg.device = (self.host_id, self.shm_probe,
                                                                 self.shm_token, self.device)

    @classmethod
    def from_proto(cls, msg) -> "NodeIdentity":
        return cls(msg.host_id, msg.shm_probe, msg.shm_token, msg.device or "cpu")


@dataclass(frozen=True)
class Reach:
    """What `me` can use to reach `peer`."""

    same_host: bool   # one kernel
    shared_shm: bool  # my process can read the peer's /dev/shm probe

    @property
    def summary(self) -> str:
        if self.shared_shm:
            return "same host, shared /dev/shm"
        return "same host, separate /dev/shm" if self.same_host else "another host"


def host_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:  # not Linux: the hostname is the best we have
        import socket
        return f"host:{socket.gethostname()}"


def read_probe(name: str) -> str | None:
    """The token in shm segment `name`, or None when this process cannot open it."""
    if not name or "/" in name:
        return None
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return None
    try:
        return os.pread(fd, _TOKEN_BYTES, 0).hex()
    finally:
        os.close(fd)


def reach(me: NodeIdentity, peer: NodeIdentity) -> Reach:
    same = bool(me.host_id) and me.host_id == peer.host_id
    shared = bool(peer.shm_token) and read_probe(peer.shm_probe) == peer.shm_token
    return Reach(same, shared)


class _Probe:
    """This process's probe segment, created once and unlinked at exit."""

    def __init__(self) -> None:
        token = secrets.token_bytes(_TOKEN_BYTES)
        self.name = f"easerve-node-{os.getpid()}-{token[:4].hex()}"
        fd = _posixshmem.shm_open("/" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o644)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        self.token = token.hex()
        resource_tracker.register("/" + self.name, "shared_memory")  # unlinked even after kill -9
        atexit.register(self.close)

    def close(self) -> None:
        try:
            _posixshmem.shm_unlink("/" + self.name)
            resource_tracker.unregister("/" + self.name, "shared_memory")
        except OSError:
            pass


_probe: _Probe | None = None


def local_identity(device: str = "cpu") -> NodeIdentity:
    """This process's identity (the probe segment is made on first call)."""
    global _probe
    if _probe is None:
        try:
            _probe = _Probe()
        except OSError:  # no /dev/shm here: peers will not use shm with us
            return NodeIdentity(host_id(), device=device)
    return NodeIdentity(host_id(), _probe.name, _probe.token, device)
