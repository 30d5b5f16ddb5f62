"""KV handoff between prefill and decode through a transport, as KVTransfer messages.

Prefill side: `KVSenders.send(addr, payload) -> (KVTransfer, sender)` picks the transport
*per decode instance* from where the two processes live (`transport.node`): when the
instance reads a shared-memory probe this process wrote -> shm (or CUDA IPC when both
ends are on one GPU, told by its UUID), anything else -> the gRPC byte stream to that instance's
KVStream service. A forced kind ("shm", "grpc", ...)
skips the choice. Decode side: `KVReceiver.fetch(msg) -> KVPayload` accepts every backend
it can. The transport moves the codec parts (typed header + raw tensors, never pickle);
the message carries only the handle (or the bytes, for inline).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from easerve.transport import KINDS
from easerve.wire.codec import kv_from_parts, kv_to_parts
from easerve.errors import InvalidRequest
from easerve.rpc.tls import NO_TLS, Tls
from easerve.transport.base import KVTransport, handle_from_proto, handle_to_proto
from easerve.transport.grpc_stream import GrpcStreamTransport, KVStreamServicer
from easerve.transport.inline import InlineTransport
from easerve.transport.node import NodeIdentity
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.types import KVPayload
from easerve.wire.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
ReachLookup = Callable[[str], Awaitable[tuple[NodeIdentity | None, bool]]]


def choose_kind(me: NodeIdentity, peer: NodeIdentity | None, shared_shm: bool) -> tuple[str, str]:
    """(transport kind, why) for sending from `me` to `peer` (None: identity unknown),
    given whether the peer read our shared-memory probe."""
    if peer is None:
        return "grpc", "the peer's node identity is unknown"
    same = me.host_id == peer.host_id
    both_gpu = me.device.startswith("cuda") and peer.device.startswith("cuda")
    if shared_shm and same and both_gpu:
        if me.gpu_uuid and me.gpu_uuid == peer.gpu_uuid:
            return "cuda_ipc", "same host, shared /dev/shm, one GPU"
        return "shm", ("shared /dev/shm; GPUs differ" if me.gpu_uuid and peer.gpu_uuid
                       else "shared /dev/shm; a GPU's UUID is unknown")
    if shared_shm:
        return "shm", "shared /dev/shm"
    return "grpc", "same host, separate /dev/shm" if same else "another host"


class KVSenders:
    """One sender per kind (a single shm slab serves every decode instance of this host),
    one gRPC stream transport per remote decode instance."""

    def __init__(self, me: NodeIdentity, reach_of: ReachLookup, kind: str = "auto", channel_options=(),
                 tls: Tls = NO_TLS):
        if kind not in KINDS:
            raise ValueError(f"--kv-transport {kind!r}: choose one of {', '.join(KINDS)}")
        self.me, self.kind, self._reach_of, self._opts = me, kind, reach_of, list(channel_options)
        self._tls = tls
        self._by_addr: dict[str, KVTransport] = {}
        self._shared: dict[str, KVTransport] = {}
        self.choices: dict[str, tuple[str, str]] = {}  # addr -> (kind, why), for /metrics and logs

    async def transport_for(self, addr: str) -> KVTransport:
        t = self._by_addr.get(addr)
        if t is None:
            kind, why = (self.kind, "set by --kv-transport") if self.kind != "auto" else \
                choose_kind(self.me, *(await self._reach_of(addr)))
            t = self._make(kind, addr)
            self._by_addr[addr], self.choices[addr] = t, (kind, why)
            log.info("KV to %s over %s (%s)", addr, kind, why)
        return t

    def _make(self, kind: str, addr: str) -> KVTransport:
        if kind == "grpc":
            return GrpcStreamTransport(peer=addr, channel_options=self._opts, tls=self._tls)
        if kind not in self._shared:
            if kind == "shm":
                self._shared[kind] = ShmTransport()
            elif kind == "cuda_ipc":
                from easerve.transport.cuda_ipc import CudaIpcTransport
                self._shared[kind] = CudaIpcTransport()
            else:
                self._shared[kind] = InlineTransport()
        return self._shared[kind]

    async def send(self, addr: str, payload: KVPayload, timeout: float | None = None,
                   stream=None) -> tuple[kv_pb2.KVTransfer, KVTransport]:
        """`stream`: the CUDA stream that wrote the payload's KV, for a transport that orders
        the receiver after it (CUDA IPC records its ready event there)."""
        t = await self.transport_for(addr)
        header, tensors = kv_to_parts(payload)
        extra = {"stream": stream} if stream is not None and t.name == "cuda_ipc" else {}
        handle = await t.send(payload.request_id, header, tensors, timeout=timeout, **extra)
        return handle_to_proto(handle), t

    async def forget(self, addr: str) -> None:
        """Drop what was kept for a decode instance that is gone (its own gRPC stream transport)."""
        t = self._by_addr.pop(addr, None)
        self.choices.pop(addr, None)
        if t is not None and t not in self._shared.values():
            await t.close()

    @staticmethod
    def release(transport: KVTransport, msg: kv_pb2.KVTransfer) -> None:
        """Free sender-side resources once decode has taken the payload (or gave up)."""
        transport.release(handle_from_proto(msg))

    def _all(self) -> list[KVTransport]:
        return list({id(t): t for t in [*self._by_addr.values(), *self._shared.values()]}.values())

    @property
    def held_bytes(self) -> int:
        """KV bytes the transports still hold for decode instances (shm regions not yet let go)."""
        return sum(t.held_bytes for t in self._all())

    async def close(self) -> None:
        for t in self._all():
            await t.close()


class KVReceiver:
    def __init__(self, transports: dict[str, KVTransport] | None = None):
        self.transports = {"inline": InlineTransport(), **(transports or {})}

    async def fetch(self, msg: kv_pb2.KVTransfer, timeout: float | None = None) -> KVPayload:
        where = msg.WhichOneof("location")
        if where is None:
            raise InvalidRequest("DecodeRequest.kv carries no payload; set inline bytes or a transport handle")
        transport = self.transports.get(where)
        if transport is None:
            raise InvalidRequest(f"this decode worker cannot receive KV over {where!r}; "
                                 f"it takes: {', '.join(self.transports)}")
        header, tensors = await transport.recv(handle_from_proto(msg), timeout=timeout)
        return kv_from_parts(header, tensors)


def receivers(device: str) -> tuple[KVReceiver, list]:
    """Decode side: a receiver for every backend this process can take, plus the
    servicers to mount (the gRPC stream's parking lot)."""
    kvs = KVStreamServicer()
    # shm: copy out of the sender's slab, so its region is back the moment the payload is read,
    # however long the payload then lives here (an engine queue, a traceback of a late request)
    found: dict[str, KVTransport] = {"shm": ShmTransport(ShmConfig(copy_out=True)),
                                     "grpc": GrpcStreamTransport(servicer=kvs)}
    if device.startswith("cuda"):
        from easerve.transport.cuda_ipc import CudaIpcTransport
        found["cuda_ipc"] = CudaIpcTransport()
    return KVReceiver(found), [(kv_pb2_grpc.add_KVStreamServicer_to_server, kvs)]
