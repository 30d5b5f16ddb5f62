"""Where a process lives, told from facts rather than names.

A stage's address says nothing about which transports reach it: compose service names
differ from container hostnames, two containers of one host may or may not share
/dev/shm, and "localhost" in a pod is not the node. So:

- every stage process publishes a `NodeIdentity` (through `easerve.v1.Stage/Load`): the
  kernel's boot id (equal on one host, containers included), its device and, on CUDA, the
  GPU's UUID (device indices depend on each process's CUDA_VISIBLE_DEVICES; the UUID does not);
- whether shared-memory handoff works is *tried*, in the direction it is used: the sender
  creates a small probe segment holding random bytes and asks the receiver
  (`Stage/ShmProbe`) to read it; the segment is unlinked right after. Only a receiver that
  read the same bytes shares the sender's /dev/shm.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass

import _posixshmem

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_TOKEN_BYTES = 16


@dataclass(frozen=True)
class NodeIdentity:
    host_id: str
    device: str = "cpu"
    gpu_uuid: str = ""  # CUDA: the GPU's UUID ("" when not CUDA or unknown)

    def to_proto(self, msg) -> None:
        msg.host_id, msg.device, msg.gpu_uuid = self.host_id, self.device, self.gpu_uuid

    @classmethod
    def from_proto(cls, msg) -> "NodeIdentity":
        return cls(msg.host_id, msg.device or "cpu", msg.gpu_uuid)


def host_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:  # not Linux: the hostname is the best we have
        import socket
        return f"host:{socket.gethostname()}"


def gpu_uuid(device: str) -> str:
    """The UUID of CUDA device `device` ("cuda", "cuda:1") as this process numbers it; ""
    for a non-CUDA device."""
    if not device.startswith("cuda"):
        return ""
    import torch
    index = torch.device(device).index or 0
    return str(torch.cuda.get_device_properties(index).uuid)


def local_identity(device: str = "cpu") -> NodeIdentity:
    return NodeIdentity(host_id(), device, gpu_uuid(device))


@contextlib.contextmanager
def shm_probe():
    """Yield (name, hex token) of a fresh probe segment; it is unlinked on exit.
    Yields (None, None) when this process has no usable /dev/shm."""
    token = secrets.token_bytes(_TOKEN_BYTES)
    name = f"easerve-probe-{os.getpid()}-{token[:6].hex()}"
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o644)
    except OSError:
        yield None, None
        return
    try:
        os.write(fd, token)
        os.close(fd)
        yield name, token.hex()
    finally:
        with contextlib.suppress(OSError):
            _posixshmem.shm_unlink("/" + name)


def read_probe(name: str) -> str | None:
    """The token in probe segment `name`, or None when this process cannot open it."""
    if not name or "/" in name or not name.startswith("easerve-probe-"):
        return None
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return None
    try:
        return os.pread(fd, _TOKEN_BYTES, 0).hex()
    finally:
        os.close(fd)
