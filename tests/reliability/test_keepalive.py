"""Keepalive: a stream held idle for a long time, on a channel that pings every second, is not
cut with GOAWAY too_many_pings by easerve's servers, and still delivers afterwards.

The idle stream is grpc.health.v1 Watch on the server every stage runs (`easerve.rpc.server.serve`):
it sends the status once, then nothing until the status changes. The client channel uses
easerve's own channel options with the keepalive time shortened to 1 s. A control shows the
test can fail: the same client against a server with gRPC's default ping policy (pings at
most every 5 minutes without data) is cut with UNAVAILABLE "Too many pings" within seconds.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from easerve.rpc.server import HealthState, ServerOptions, serve
from easerve.rpc.tls import aio_channel

pytestmark = pytest.mark.slow  # idles 12 s on purpose
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
IDLE_S = 12.0
FAST_PINGS = ServerOptions(keepalive_time_ms=1000).channel_options()  # easerve's options, 1 s keepalive


def _watch(ch, service: str):
    return health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service))


def test_an_idle_stream_outlives_many_keepalive_pings():
    async def main():
        stop, ports, state = asyncio.Event(), [], HealthState()
        task = asyncio.create_task(serve([], "127.0.0.1:0", health_services=["easerve.v1.Decode"], stop=stop,
                                         grace_s=0.5, on_bound=ports.append, health_state=state))
        try:
            while not ports:
                await asyncio.sleep(0.01)
            async with aio_channel(f"127.0.0.1:{ports[0]}", FAST_PINGS) as ch:
                await ch.channel_ready()
                call = _watch(ch, "easerve.v1.Decode")
                first = await call.read()
                while first.status != SERVING:  # NOT_SERVING until serve() has warmed up
                    first = await call.read()
                t0 = time.monotonic()
                asyncio.get_running_loop().call_later(IDLE_S, state.fail, "the test ends the idle period")
                after = await asyncio.wait_for(call.read(), IDLE_S + 10)  # raises AioRpcError if cut
                idle = time.monotonic() - t0
                assert after.status == NOT_SERVING and idle >= IDLE_S - 0.5, (after, idle)
                assert ch.get_state() == grpc.ChannelConnectivity.READY
                check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert check.status == NOT_SERVING
                call.cancel()
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_control_a_default_ping_policy_cuts_the_same_stream():
    async def main():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # gRPC's default keepalive policy
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("x", SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}", FAST_PINGS) as ch:
                call = _watch(ch, "x")
                assert (await call.read()).status == SERVING
                with pytest.raises(grpc.aio.AioRpcError) as cut:
                    await asyncio.wait_for(call.read(), IDLE_S)
                assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "too many pings" in (cut.value.details() or "").lower()
        finally:
            await server.stop(0)

    asyncio.run(main())
