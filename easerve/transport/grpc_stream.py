"""Anywhere transport: the codec frame pushed in chunks over the KVStream service.

Receiver: a `KVStreamServicer` (register it on the receiver's gRPC server) parks each pushed
payload under its key until `recv(handle)` takes it, or until it expires. A push whose next
chunk does not come within `stall_s` is aborted (DEADLINE_EXCEEDED) and its buffer dropped;
`held_bytes` counts what is parked and what is still arriving. Sender: pushes to the
receiver's address and returns a handle once the receiver has acknowledged the payload; a
receiver that does not answer within the call's timeout (or is unreachable) is a
DeadlineExceeded (or Unavailable) naming it. Before a push the sender waits up to `connect_s`
for its channel to be connected: a channel still backing off from an attempt made before the
receiver was listening (at start-up, or while it restarted) would otherwise fail the push at
once with the stale "connection refused", although the receiver is up.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
import numpy as np
import torch

from easerve.wire import codec
from easerve.rpc.errors import from_rpc_error, grpc_errors
from easerve.errors import DeadlineExceeded, InvalidRequest, NotFound, Overloaded, Unavailable
from easerve.rpc.tls import NO_TLS, Tls, aio_channel, connected
from easerve.transport.base import KVTransport
from easerve.transport.handles import GrpcHandle, Handle
from easerve.wire.v1 import kv_pb2, kv_pb2_grpc


@dataclass(frozen=True)
class GrpcStreamConfig:
    chunk_bytes: int = 1 << 20
    park_ttl_s: float = 60.0  # receiver drops payloads nobody took within this time
    max_parked_bytes: int = 8 << 30
    recv_timeout_s: float = 30.0  # how long recv() waits for a payload still in flight
    stall_s: float = 10.0  # receiver aborts a push whose next chunk takes longer than this
    connect_s: float = 3.0  # sender waits this long (within the call's timeout) for the receiver's connection

    def __post_init__(self) -> None:
        if not 4 << 10 <= self.chunk_bytes <= 64 << 20:
            raise ValueError(f"chunk_bytes must be in [4 KiB, 64 MiB], got {self.chunk_bytes}")
        if min(self.park_ttl_s, self.recv_timeout_s, self.stall_s, self.connect_s) <= 0:
            raise ValueError("park_ttl_s, recv_timeout_s, stall_s and connect_s must be > 0 seconds")
        if self.max_parked_bytes <= 0:
            raise ValueError(f"max_parked_bytes must be > 0, got {self.max_parked_bytes}")


class KVStreamServicer(kv_pb2_grpc.KVStreamServicer):
    """Receiver side: assembles pushed payloads and parks them by key."""

    def __init__(self, config: GrpcStreamConfig = GrpcStreamConfig()) -> None:
        self.config = config
        self._parked: dict[str, tuple[float, np.ndarray]] = {}
        self._arriving: dict[int, int] = {}  # push -> bytes of its buffer, until parked or dropped
        self._pushes = itertools.count()
        self._arrived = asyncio.Condition()

    @property
    def parked_bytes(self) -> int:
        return sum(len(b) for _, b in self._parked.values())

    @property
    def held_bytes(self) -> int:
        """Parked payloads plus the buffers of pushes still arriving."""
        return self.parked_bytes + sum(self._arriving.values())

    @grpc_errors
    async def Push(self, request_iterator: AsyncIterator[kv_pb2.KVChunk], context) -> kv_pb2.KVPushAck:
        self._sweep()
        push = next(self._pushes)
        try:
            key, buf, ttl = await self._receive(aiter(request_iterator), push)
        finally:
            self._arriving.pop(push, None)
        async with self._arrived:
            self._parked[key] = (time.monotonic() + ttl, buf)
            self._arrived.notify_all()
        return kv_pb2.KVPushAck(key=key, received_bytes=len(buf))

    async def _receive(self, chunks, push: int) -> tuple[str, np.ndarray, float]:
        """(key, payload, park TTL) of one push; DeadlineExceeded when it stalls."""
        key, buf, pos, ttl = "", np.empty(0, np.uint8), 0, 0.0
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), self.config.stall_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"KV push {key or '(no key yet)'!r} stalled: no chunk for "
                                       f"{self.config.stall_s:g} s after {pos} of {len(buf)} bytes; "
                                       "dropped") from None
            if not key:
                key, buf, ttl = self._start(chunk)
                self._arriving[push] = len(buf)
            data = chunk.data
            if pos + len(data) > len(buf):
                raise InvalidRequest(f"payload {key!r} overflows its declared {len(buf)} bytes")
            buf[pos: pos + len(data)] = np.frombuffer(data, np.uint8)
            pos += len(data)
        if not key or pos != len(buf):
            raise InvalidRequest(f"payload {key!r} ended at {pos} of {len(buf)} bytes")
        return key, buf, ttl

    def _start(self, chunk: kv_pb2.KVChunk) -> tuple[str, np.ndarray, float]:
        if not chunk.key:
            raise InvalidRequest("the first KVChunk must carry the payload key")
        if chunk.total_bytes > self.config.max_parked_bytes:
            raise InvalidRequest(f"payload {chunk.key!r} declares {chunk.total_bytes} bytes; this receiver parks "
                                 f"at most {self.config.max_parked_bytes}: send a smaller payload")
        if self.held_bytes + chunk.total_bytes > self.config.max_parked_bytes:
            raise Overloaded(f"{self.held_bytes} bytes parked or arriving; no room for {chunk.total_bytes} more")
        ttl = min(self.config.park_ttl_s, chunk.deadline_ms / 1000 or self.config.park_ttl_s)
        return chunk.key, np.empty(chunk.total_bytes, np.uint8), ttl  # not zeroed: one pass

    async def take(self, key: str, timeout: float) -> np.ndarray:
        """The payload parked under `key` (waiting up to `timeout` for it to arrive)."""
        self._sweep()
        async def wait() -> np.ndarray:
            async with self._arrived:
                await self._arrived.wait_for(lambda: key in self._parked)
                return self._parked.pop(key)[1]
        try:
            return await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no KV payload {key!r} arrived within {timeout:.1f}s") from None

    def drop(self, key: str) -> bool:
        return self._parked.pop(key, None) is not None

    def _sweep(self) -> None:
        now = time.monotonic()
        for key, (expiry, _) in list(self._parked.items()):
            if expiry <= now:
                del self._parked[key]


class GrpcStreamTransport(KVTransport):
    """`peer`: the receiver's address (sender side). `servicer`: this process's parking lot
    (receiver side). A process may be both."""

    name = "grpc"

    def __init__(self, *, peer: str | None = None, servicer: KVStreamServicer | None = None,
                 config: GrpcStreamConfig = GrpcStreamConfig(), channel_options: Sequence = (),
                 tls: Tls = NO_TLS) -> None:
        super().__init__()
        if peer is None and servicer is None:
            raise ValueError("give peer= (to send), servicer= (to receive), or both")
        self.peer, self.servicer, self.config = peer, servicer, config
        self._options, self._tls = list(channel_options), tls
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> kv_pb2_grpc.KVStreamStub:
        if self.peer is None:
            raise ValueError("this grpc transport has no peer= to send to")
        if self._channel is None:
            self._channel = aio_channel(self.peer, self._options, self._tls)
        return kv_pb2_grpc.KVStreamStub(self._channel)

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> GrpcHandle:
        stub, t0 = self._stub(), time.perf_counter()
        total, key = codec.frame_size(header), f"{request_id}/{uuid.uuid4().hex[:12]}"
        await self._connected(key, timeout)
        left = None if timeout is None else max(1e-3, timeout - (time.perf_counter() - t0))
        deadline_ms = int(left * 1000) if left else 0
        chunks = _chunks(key, total, deadline_ms, codec.iter_frame(header, tensors), self.config.chunk_bytes)
        try:
            ack = await stub.Push(chunks, timeout=left)
        except grpc.aio.AioRpcError as e:
            raise _push_error(e, self.peer, key, timeout) from None
        if ack.received_bytes != total:
            raise InvalidRequest(f"receiver took {ack.received_bytes} of {total} bytes of {key!r}")
        self._measured(total, t0)
        return GrpcHandle(request_id, self.peer, key, total)

    async def _connected(self, key: str, timeout: float | None) -> None:
        """Return once the channel to the receiver is connected: Unavailable naming it when
        that takes longer than connect_s, DeadlineExceeded when the call's timeout ends first."""
        wait = self.config.connect_s if timeout is None else min(self.config.connect_s, timeout)
        if not await connected(self._channel, wait):
            if timeout is not None and timeout <= self.config.connect_s:
                raise DeadlineExceeded(f"KV push {key!r} to {self.peer}: no answer within {timeout} s "
                                       f"(not connected)")
            raise Unavailable(f"KV push {key!r} to {self.peer}: receiver unreachable "
                              f"(not connected within {wait:g} s)")

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, GrpcHandle)
        if self.servicer is None:
            raise NotFound("this grpc transport has no KVStream servicer to receive into")
        t0 = time.perf_counter()
        buf = await self.servicer.take(handle.key, timeout or self.config.recv_timeout_s)
        out = codec.split_parts(buf, copy=False)  # the buffer is ours alone: views are safe
        self._measured(len(buf), t0)
        return out

    def release(self, handle: Handle) -> None:
        if isinstance(handle, GrpcHandle) and self.servicer is not None:
            self.servicer.drop(handle.key)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _push_error(e: grpc.aio.AioRpcError, peer: str, key: str, timeout: float | None) -> Exception:
    """A failed push as the domain error, naming the receiver (a stalled or unreachable
    decode instance reads differently from a refusal it sent)."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"KV push {key!r} to {peer}: no answer within "
                                f"{timeout if timeout is not None else 'the deadline'} s ({e.details()})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"KV push {key!r} to {peer}: receiver unreachable ({e.details()})")
    return from_rpc_error(e)


async def _chunks(key, total, deadline_ms, pieces, chunk_bytes) -> AsyncIterator[kv_pb2.KVChunk]:
    """KVChunk messages of at most chunk_bytes, the first one naming the payload."""
    first, pending, size = True, [], 0
    for piece in pieces:
        while len(piece):
            take = piece[: chunk_bytes - size]
            pending.append(take)
            size += len(take)
            piece = piece[len(take):]
            if size == chunk_bytes:
                yield _chunk(first, key, total, deadline_ms, pending)
                first, pending, size = False, [], 0
    if pending or first:
        yield _chunk(first, key, total, deadline_ms, pending)


def _chunk(first, key, total, deadline_ms, pieces) -> kv_pb2.KVChunk:
    data = b"".join(pieces)
    if first:
        return kv_pb2.KVChunk(key=key, total_bytes=total, deadline_ms=deadline_ms, data=data)
    return kv_pb2.KVChunk(data=data)
