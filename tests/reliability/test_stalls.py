"""Stalled and dead peers end in a timeout error within the deadline, and what they held is
given back: a KV push to a peer that accepts and never answers, a push that stalls midway,
a KV payload that never arrives, an embedding transfer (encode -> remote prefill) to a
prefill that never answers. The peers are real sockets: a TCP listener that accepts and
never speaks HTTP/2, and a gRPC server whose every method accepts the call and never
answers. (A shm region whose reader died: tests/reliability/test_shm_race.py.)
"""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from easerve.wire import codec
from easerve.errors import DeadlineExceeded, Unavailable
from easerve.stages.common.peers import Peers
from easerve.transport.grpc_stream import GrpcStreamConfig, GrpcStreamTransport, KVStreamServicer
from easerve.transport.handles import GrpcHandle
from easerve.transport.handoff import KVReceiver, KVSenders
from easerve.transport.node import local_identity
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import kv_pb2, kv_pb2_grpc, prefill_pb2, prefill_pb2_grpc

SLACK_S = 2.0  # scheduling noise on a loaded host, on top of each deadline


def kv(tokens: int = 64, rid: str = "r1") -> KVPayload:
    import torch
    mk = lambda: torch.randn(2, tokens, 16).to(torch.bfloat16)  # noqa: E731
    return KVPayload(rid, [mk(), mk()], [mk(), mk()], prompt_len=tokens, rope_delta=0, first_token=3,
                     sampling=SamplingParams())


class TcpHole:
    """Accepts TCP connections and never reads or writes: no HTTP/2 handshake ever comes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []

    async def start(self) -> None:
        self.sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            self.conns.append(conn)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        for c in self.conns:
            c.close()
        self.sock.close()


class GrpcHole:
    """A gRPC server that accepts every call (any service, any method) and never answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def start(self) -> None:
        async def hang(request_iterator, context):
            self.calls += 1
            await asyncio.Event().wait()

        class Any(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.stream_stream_rpc_method_handler(hang)

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([Any()])
        self.addr = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


HOLES = {"tcp-accepts-never-speaks": TcpHole, "grpc-accepts-never-answers": GrpcHole}


@pytest.mark.parametrize("hole_kind", list(HOLES))
def test_kv_push_to_a_peer_that_never_answers_times_out_naming_it(hole_kind):
    async def main():
        hole = HOLES[hole_kind]()
        await hole.start()
        senders = KVSenders(local_identity("cpu"), None, kind="grpc")
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match=f"KV push .* to {hole.addr}: no answer within 1.0 s"):
                await senders.send(hole.addr, kv(), timeout=1.0)
            assert time.monotonic() - t0 < 1.0 + SLACK_S
            if isinstance(hole, GrpcHole):
                assert hole.calls == 1  # the call did reach it
        finally:
            await senders.close()
            await hole.stop()
    asyncio.run(main())


async def _kv_server(config: GrpcStreamConfig):
    servicer = KVStreamServicer(config)
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStreamServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return servicer, server, addr


def test_kv_push_that_stalls_midway_is_aborted_and_its_buffer_dropped():
    """The sender sends the first of two 1 MiB chunks and goes silent (no deadline of its
    own): the receiver aborts the push after stall_s and holds nothing; the decode side's
    take of that key times out; a whole push afterwards still works."""
    async def main():
        servicer, server, addr = await _kv_server(GrpcStreamConfig(stall_s=0.5))
        stalled = asyncio.Event()
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = kv_pb2_grpc.KVStreamStub(ch)

                async def chunks():
                    yield kv_pb2.KVChunk(key="r1/x", total_bytes=2 << 20, data=bytes(1 << 20))
                    stalled.set()
                    await asyncio.Event().wait()

                call = stub.Push(chunks())
                await stalled.wait()
                await asyncio.sleep(0.1)
                assert servicer.held_bytes == 2 << 20  # the partial buffer, while it arrives
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "stalled: no chunk for 0.5 s after 1048576 of 2097152 bytes" in e.value.details()
                assert time.monotonic() - t0 < 0.5 + SLACK_S
                assert servicer.held_bytes == 0
                with pytest.raises(DeadlineExceeded, match="no KV payload 'r1/x' arrived within 0.3s"):
                    await KVReceiver({"grpc": GrpcStreamTransport(servicer=servicer)}).fetch(
                        _grpc_msg("r1", addr, "r1/x"), timeout=0.3)
            sender = GrpcStreamTransport(peer=addr)
            p = kv()
            handle = await sender.send(p.request_id, *codec.kv_to_parts(p), timeout=5)
            got = await KVReceiver({"grpc": GrpcStreamTransport(servicer=servicer)}).fetch(_grpc_msg(
                p.request_id, addr, handle.key), timeout=5)
            assert got.request_id == "r1" and servicer.held_bytes == 0
            await sender.close()
        finally:
            await server.stop(0)
    asyncio.run(main())


def _grpc_msg(rid: str, addr: str, key: str) -> kv_pb2.KVTransfer:
    from easerve.transport.handles import handle_to_proto
    return handle_to_proto(GrpcHandle(rid, addr, key, 0))


def test_kv_push_to_an_unreachable_receiver_is_unavailable_naming_it():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens here once closed
        sender = GrpcStreamTransport(peer=addr)
        try:
            p = kv()
            with pytest.raises(Unavailable, match=f"KV push .* to {addr}: receiver unreachable"):
                await sender.send(p.request_id, *codec.kv_to_parts(p), timeout=5)
        finally:
            await sender.close()
    asyncio.run(main())


def test_kv_push_to_a_receiver_that_just_came_up_waits_out_the_stale_backoff():
    """First contact: a push tried before the receiver listened leaves the channel in
    reconnect backoff (1.5 s here); the receiver then comes up and the next push, made
    within that backoff, still lands (the sender waits for the connection, up to
    connect_s) instead of failing at once with the old "connection refused"."""
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"
        backoff = [(f"grpc.{k}_reconnect_backoff_ms", 1500) for k in ("initial", "min", "max")]
        sender = GrpcStreamTransport(peer=addr, channel_options=backoff)
        server = None
        try:
            p = kv()
            with pytest.raises(DeadlineExceeded, match=fr"to {addr}: no answer within 0.3 s \(not connected\)"):
                await sender.send(p.request_id, *codec.kv_to_parts(p), timeout=0.3)
            servicer = KVStreamServicer()
            server = grpc.aio.server()
            kv_pb2_grpc.add_KVStreamServicer_to_server(servicer, server)
            assert server.add_insecure_port(addr) == int(addr.rsplit(":", 1)[1])
            await server.start()
            handle = await sender.send(p.request_id, *codec.kv_to_parts(p), timeout=5)
            got = await KVReceiver({"grpc": GrpcStreamTransport(servicer=servicer)}).fetch(
                _grpc_msg(p.request_id, addr, handle.key), timeout=5)
            assert got.request_id == p.request_id
        finally:
            await sender.close()
            if server is not None:
                await server.stop(0)
    asyncio.run(main())


@pytest.mark.parametrize("hole_kind", list(HOLES))
def test_embedding_transfer_to_a_prefill_that_never_answers(hole_kind):
    """encode -> remote prefill goes through Peers.start_call (embeddings inline in the
    Prefill call): the call ends DEADLINE_EXCEEDED at its deadline, naming the instance;
    the poll then marks the instance down and new calls are refused at once (UNAVAILABLE)."""
    async def main():
        hole = HOLES[hole_kind]()
        await hole.start()
        peers = Peers(prefill_pb2_grpc.PrefillStub, [hole.addr], service="easerve.v1.Prefill", poll_s=0.25)
        msg = prefill_pb2.PrefillRequest(meta=cpb.RequestMeta(request_id="e1", deadline_ms=1000),
                                         input_ids=[1, 2, 3])
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match=f"easerve.v1.Prefill at {hole.addr}: Deadline Exceeded"):
                await peers.start_call(lambda p: p.stub.Prefill(msg, timeout=1.0))
            assert time.monotonic() - t0 < 1.0 + SLACK_S
            assert peers.get(hole.addr).outstanding == 0  # the caller's count is given back
            peers.start()
            end = time.monotonic() + 10
            while peers.get(hole.addr).up and time.monotonic() < end:
                await asyncio.sleep(0.1)
            assert not peers.get(hole.addr).up, "the poll did not mark the silent instance down"
            with pytest.raises(Unavailable, match=f"every easerve.v1.Prefill instance is down or not serving: "
                                                  f"{hole.addr}"):
                peers.pick()
        finally:
            await peers.close()
            await hole.stop()
    asyncio.run(main())
