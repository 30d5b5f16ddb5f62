"""KV handoff (prefill -> decode) and embedding handoff (encode -> remote prefill) through a
transport, as KVTransfer messages: one set of transports, chosen the same way, for both.

Prefill side: `KVSenders.send(addr, payload) -> (KVTransfer, sender)` picks the transport
*per decode instance* from where the two processes live (`transport.node`): when the
instance reads a shared-memory probe this process wrote -> shm (or CUDA IPC when both
ends are on one GPU, told by its UUID); two GPUs without shared memory -> an NCCL pair group
with that instance (`transport.nccl_pairs`, when it advertises a rendezvous), anything else ->
the gRPC byte stream to that instance's KVStream service. A forced kind ("shm", "grpc", "nccl",
...) skips the choice ("nccl" with a CPU end: the same pair group over gloo). Decode side:
`KVReceiver.fetch(msg) -> KVPayload` accepts every backend
it can. The transport moves the codec parts (typed header + raw tensors, never pickle);
the message carries only the handle (or the bytes, for inline).

Embeddings (`send_parts` / `fetch_parts` with `codec.embeddings_to_parts`): encode holds a
KVSenders over its remote prefill instances made with `byte_stream=False` (a prefill serves
no KVStream: where the choice would be the gRPC byte stream, the payload travels inline in
the message, the fallback); prefill takes them with `embedding_receiver(device)`, whose
shared-memory receiver hands out views of the sender's slab (no copy; the region is back
once the request's last view of it dies). Both ends count the tensor bytes they moved by
transport (`sent_bytes`, `received_bytes`; "inline": bytes carried inside the message).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import torch

from easerve.transport import KINDS
from easerve.wire.codec import kv_from_parts, kv_to_parts
from easerve.errors import InvalidRequest, Unavailable
from easerve.rpc.tls import NO_TLS, Tls
from easerve.transport.base import KVTransport, handle_from_proto, handle_to_proto, tensor_bytes
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
    if me.device.startswith("cuda") and peer.device.startswith("cuda") and peer.kv_rendezvous:
        return "nccl", "GPUs without shared /dev/shm: an NCCL pair group"
    return "grpc", "same host, separate /dev/shm" if same else "another host"


class KVSenders:
    """One sender per kind (a single shm slab serves every decode instance of this host),
    one gRPC stream transport or NCCL pair group per remote decode instance."""

    def __init__(self, me: NodeIdentity, reach_of: ReachLookup, kind: str = "auto", channel_options=(),
                 tls: Tls = NO_TLS, byte_stream: bool = True):
        """`byte_stream=False`: the receivers serve no KVStream; where the choice would be the
        gRPC byte stream ("grpc"), the payload travels inline in the message instead."""
        if kind not in KINDS:
            raise ValueError(f"--kv-transport {kind!r}: choose one of {', '.join(KINDS)}")
        self.me, self.kind, self._reach_of, self._opts = me, kind, reach_of, list(channel_options)
        self._tls, self._byte_stream = tls, byte_stream
        self.sent_bytes: Counter[str] = Counter()  # tensor bytes handed over so far, by transport
        self._by_addr: dict[str, KVTransport] = {}
        self._shared: dict[str, KVTransport] = {}
        self._choosing: dict[str, asyncio.Lock] = {}  # one choice (and one pair formed) per instance
        self.choices: dict[str, tuple[str, str]] = {}  # addr -> (kind, why), for /metrics and logs

    async def transport_for(self, addr: str) -> KVTransport:
        t = self._by_addr.get(addr)
        if t is not None and not getattr(t, "stopped", None):
            return t
        async with self._choosing.setdefault(addr, asyncio.Lock()):
            t = self._by_addr.get(addr)
            if t is not None and getattr(t, "stopped", None):  # a broken pair: form a new one
                await self.forget(addr)
                t = None
            return t if t is not None else await self._choose(addr)

    async def _choose(self, addr: str) -> KVTransport:
        peer, shared = await self._reach_of(addr) if self.kind in ("auto", "nccl") else (None, False)
        kind, why = (self.kind, "set by --kv-transport") if self.kind != "auto" else \
            choose_kind(self.me, peer, shared)
        if kind == "grpc" and not self._byte_stream:
            kind, why = "inline", f"{why}: inline in the message"
        t = await self._pair(addr, peer) if kind == "nccl" else self._make(kind, addr)
        self._by_addr[addr], self.choices[addr] = t, (kind, why)
        log.info("%s to %s over %s (%s)", "KV" if self._byte_stream else "embeddings", addr, kind, why)
        return t

    async def _pair(self, addr: str, peer: NodeIdentity | None) -> KVTransport:
        """This instance's own pair group with the decode instance at `addr` (a new one per
        instance that comes; `forget` ends it when the instance goes)."""
        if peer is None or not peer.kv_rendezvous:
            raise Unavailable(f"decode instance {addr} advertises no NCCL rendezvous (its node identity "
                              f"{'is unknown' if peer is None else 'has none'}); start it with --kv-rendezvous "
                              f"or choose another --kv-transport")
        from easerve.transport.nccl_pairs import connect_pair
        return await connect_pair(peer.kv_rendezvous, self.me.device, peer.device)

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
        header, tensors = kv_to_parts(payload)
        return await self.send_parts(addr, payload.request_id, header, tensors, timeout, stream)

    async def send_parts(self, addr: str, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                         timeout: float | None = None, stream=None) -> tuple[kv_pb2.KVTransfer, KVTransport]:
        """Any codec payload (KV, embeddings) to the instance at `addr`: (its message, the
        transport to `release` it on once the receiver is done or the call failed)."""
        t = await self.transport_for(addr)
        extra = {"stream": stream} if stream is not None and t.name == "cuda_ipc" else {}
        handle = await t.send(request_id, header, tensors, timeout=timeout, **extra)
        self.sent_bytes[t.name] += tensor_bytes(tensors)
        return handle_to_proto(handle), t

    async def forget(self, addr: str) -> None:
        """Drop what was kept for a decode instance that is gone (its own gRPC stream
        transport or NCCL pair group)."""
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
    def __init__(self, transports: dict[str, KVTransport] | None = None, what: str = "KV"):
        self.transports = {"inline": InlineTransport(), **(transports or {})}
        self.what = what  # what it takes, for its errors
        self.received_bytes: Counter[str] = Counter()  # tensor bytes taken in so far, by transport

    async def fetch(self, msg: kv_pb2.KVTransfer, timeout: float | None = None) -> KVPayload:
        return kv_from_parts(*await self.fetch_parts(msg, timeout))

    async def fetch_parts(self, msg: kv_pb2.KVTransfer, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        """The codec parts a message points to (once)."""
        where = msg.WhichOneof("location")
        if where is None:
            raise InvalidRequest(f"the {self.what} transfer carries no payload; set inline bytes or a transport handle")
        transport = self.transports.get(where)
        if transport is None:
            raise InvalidRequest(f"this worker cannot receive {self.what} over {where!r}; "
                                 f"it takes: {', '.join(self.transports)}")
        header, tensors = await transport.recv(handle_from_proto(msg), timeout=timeout)
        self.received_bytes[where] += tensor_bytes(tensors)
        return header, tensors


def receivers(device: str, rendezvous: str = "") -> tuple[KVReceiver, list]:
    """Decode side: a receiver for every backend this process can take, plus the
    servicers to mount (the gRPC stream's parking lot). `rendezvous` (host:port): where
    prefill instances form NCCL pair groups with this one ("" : none)."""
    kvs = KVStreamServicer()
    # shm: copy out of the sender's slab, so its region is back the moment the payload is read,
    # however long the payload then lives here (an engine queue, a traceback of a late request)
    found: dict[str, KVTransport] = {"shm": ShmTransport(ShmConfig(copy_out=True)),
                                     "grpc": GrpcStreamTransport(servicer=kvs)}
    if device.startswith("cuda"):
        from easerve.transport.cuda_ipc import CudaIpcTransport
        found["cuda_ipc"] = CudaIpcTransport()
    if rendezvous:
        from easerve.transport.nccl_pairs import PairRendezvous
        found["nccl"] = PairRendezvous(rendezvous, device)
    return KVReceiver(found), [(kv_pb2_grpc.add_KVStreamServicer_to_server, kvs)]


def embedding_receiver(device: str, rendezvous: str = "") -> KVReceiver:
    """Prefill side: embeddings from encode over every backend this process can take. Shared
    memory is viewed in place (no copy): the sender's slab region is back once the request's
    last view of it dies; a one-off segment lives while mapped. `rendezvous` (host:port):
    where encode instances form NCCL pair groups with this one ("": none)."""
    found: dict[str, KVTransport] = {"shm": ShmTransport(ShmConfig(copy_out=False))}
    if device.startswith("cuda"):
        from easerve.transport.cuda_ipc import CudaIpcTransport
        found["cuda_ipc"] = CudaIpcTransport()
    if rendezvous:
        from easerve.transport.nccl_pairs import PairRendezvous
        found["nccl"] = PairRendezvous(rendezvous, device)
    return KVReceiver(found, what="embeddings")
