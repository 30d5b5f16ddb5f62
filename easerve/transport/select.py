"""Pick a transport for a (sender, receiver) pair from where the two ends live."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection

TRANSPORTS = ("cuda_ipc", "nccl", "shm", "grpc")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_FALLBACK = {"cuda_ipc": "shm", "nccl": "grpc", "shm": "grpc"}


@dataclass(frozen=True)
class Endpoint:
    """Where a stage runs. `node` identifies the host (same string = same shared memory and
    CUDA IPC domain: use the hostname or the Kubernetes node name, not the service address)."""

    address: str
    node: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError(f"Endpoint {self.address!r} needs a node (e.g. socket.gethostname())")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class TransportChoice:
    name: str
    reason: str


def select_transport(src: Endpoint, dst: Endpoint, *,
                     available: Collection[str] = TRANSPORTS) -> TransportChoice:
    """same node + both GPU -> cuda_ipc; other nodes + both GPU -> nccl; same node -> shm;
    else grpc. A backend missing from `available` falls back (cuda_ipc -> shm -> grpc,
    nccl -> grpc); "grpc" is always possible."""
    same = src.node == dst.node
    where = f"{src.address} ({src.node}, {src.device}) -> {dst.address} ({dst.node}, {dst.device})"
    if same and src.gpu and dst.gpu:
        name, why = "cuda_ipc", "same node, both on GPU"
    elif src.gpu and dst.gpu:
        name, why = "nccl", "different nodes, both on GPU"
    elif same:
        name, why = "shm", "same node, not both on GPU"
    else:
        name, why = "grpc", "different nodes, not both on GPU"
    while name != "grpc" and name not in available:
        name, why = _FALLBACK[name], f"{why}; {name} unavailable, fell back to {_FALLBACK[name]}"
    return TransportChoice(name, f"{why}: {where}")
