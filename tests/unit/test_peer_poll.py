"""How the health poll decides an instance is down: a refused poll (UNAVAILABLE: the process
is gone) at once; a poll that times out only after DOWN_AFTER_TIMEOUTS in a row, since a
process busy on a small machine misses one deadline now and then (marked down, its cached
media were routed to an instance without them: the encoder cache test saw it on 2 cores);
an answered poll clears the count. The stubs are scripted; `Peers.poll_once()` drives it."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from easerve.stages.common.peers import DOWN_AFTER_TIMEOUTS, Peers
from easerve.wire.v1 import prefill_pb2_grpc, stage_pb2

ADDR = "127.0.0.1:9"  # never dialled: the stubs below answer
SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _err(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class _Scripted:
    """A health stub answering each Check with the next scripted outcome (a StatusCode: that error)."""

    def __init__(self, outcomes: list):
        self.outcomes = list(outcomes)

    async def Check(self, request, timeout=None):
        o = self.outcomes.pop(0)
        if isinstance(o, grpc.StatusCode):
            raise _err(o)
        return o


class _Load:
    async def Load(self, request, timeout=None):
        return stage_pb2.LoadResponse(inflight=2, max_inflight=8)


def _states(outcomes: list) -> list[bool]:
    async def go():
        peers = Peers(prefill_pb2_grpc.PrefillStub, [ADDR], service="easerve.v1.Prefill")
        p = peers.get(ADDR)
        p.health_stub, p.load_stub = _Scripted(outcomes), _Load()
        out = []
        try:
            for _ in outcomes:
                await peers.poll_once()
                out.append(p.up)
        finally:
            await p.channel.close()
        return out
    return asyncio.run(go())


def test_timeouts_below_the_threshold_keep_an_instance_up_and_an_answer_resets_the_count():
    slow = grpc.StatusCode.DEADLINE_EXCEEDED
    script = [slow] * (DOWN_AFTER_TIMEOUTS - 1) + [SERVING] + [slow] * (DOWN_AFTER_TIMEOUTS - 1) + [SERVING]
    assert _states(script) == [True] * len(script)


def test_consecutive_timeouts_mark_it_down_and_an_answer_brings_it_back():
    slow = grpc.StatusCode.DEADLINE_EXCEEDED
    script = [slow] * DOWN_AFTER_TIMEOUTS + [SERVING]
    assert _states(script) == [True] * (DOWN_AFTER_TIMEOUTS - 1) + [False, True]


def test_a_refused_poll_marks_it_down_at_once():
    assert _states([grpc.StatusCode.UNAVAILABLE, SERVING]) == [False, True]
    assert DOWN_AFTER_TIMEOUTS >= 2  # else the tests above prove nothing
