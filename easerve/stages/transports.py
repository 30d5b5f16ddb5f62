"""Which KV transport a stage uses, from where its peer lives.

Decode (the receiver) accepts every backend it can: inline, shm, the gRPC byte
stream (its KVStream service rides on the decode server), and CUDA IPC on a GPU.
Prefill (the sender) picks per peer with `select_transport`: same host -> shm (or
CUDA IPC when both ends are on GPUs), another host -> the gRPC stream. NCCL needs
a rank pair set up by the deployment, so it is chosen only when asked for.
"""
from __future__ import annotations

import socket

from easerve.transport.base import KVTransport
from easerve.transport.grpc_stream import GrpcStreamTransport, KVStreamServicer
from easerve.transport.inline import InlineTransport
from easerve.transport.select import Endpoint, select_transport
from easerve.transport.shm import ShmTransport
from easerve.v1 import kv_pb2_grpc

_LOCAL = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"}


def node_of(addr: str) -> str:
    """The host an address points at, with loopback names folded into this host."""
    host = addr.rpartition(":")[0]
    me = socket.gethostname()
    return me if host in _LOCAL or host == me else host


def receivers(device: str, options) -> tuple[dict[str, KVTransport], list]:
    """Decode side: transports by KVTransfer location name, plus servicers to mount."""
    kvs = KVStreamServicer()
    found: dict[str, KVTransport] = {"inline": InlineTransport(), "shm": ShmTransport(),
                                     "grpc": GrpcStreamTransport(servicer=kvs)}
    if device.startswith("cuda"):
        from easerve.transport.cuda_ipc import CudaIpcTransport
        found["cuda_ipc"] = CudaIpcTransport()
    return found, [(kv_pb2_grpc.add_KVStreamServicer_to_server, kvs)]


def sender_for(kind: str, device: str, peer_addr: str, options, peer_device: str | None = None) -> KVTransport:
    """Prefill side: the transport to `peer_addr` ("auto" picks by location)."""
    if kind == "auto":
        me = Endpoint("self", socket.gethostname(), device)
        peer = Endpoint(peer_addr, node_of(peer_addr), peer_device or device)
        kind = select_transport(me, peer, available=("cuda_ipc", "shm", "grpc")).name
    if kind == "inline":
        return InlineTransport()
    if kind == "shm":
        return ShmTransport()
    if kind == "grpc":
        return GrpcStreamTransport(peer=peer_addr, channel_options=options.channel_options())
    if kind == "cuda_ipc":
        from easerve.transport.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport()
    raise ValueError(f"--kv-transport {kind!r} needs a deployment-level setup (nccl ranks); "
                     "use auto, inline, shm, grpc or cuda_ipc")
