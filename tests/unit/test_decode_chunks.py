"""The gateway's reading of a decode stream (easerve.stages.gateway.choices.decode_chunks):
chunks pass through while the KV handoff runs and after it; a stream that goes quiet for the
progress deadline is DecodeStalled; a stream closed early or a failed handoff ends it."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from easerve.errors import DecodeStalled, Unavailable
from easerve.stages.gateway.choices import decode_chunks
from easerve.wire.v1 import common_pb2


class Stream:
    """A decode call's read(): the scripted chunks, each after its delay; then EOF or silence."""

    def __init__(self, chunks, delays, then_silent: bool = False):
        self.items, self.delays, self.silent = list(chunks), list(delays), then_silent

    async def read(self):
        if not self.items:
            if self.silent:
                await asyncio.sleep(3600)
            return grpc.aio.EOF
        await asyncio.sleep(self.delays.pop(0))
        return self.items.pop(0)


def chunk(*ids) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(request_id="r", token_ids=list(ids))


async def collect(stream, tail, progress_s, got=None):
    got = [] if got is None else got
    async for c in decode_chunks(stream, tail, "dec-1:9", 1, progress_s):
        got.append(list(c.token_ids))
    return got


def done_tail():
    f = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f


def test_chunks_pass_through_before_and_after_the_handoff_ends():
    got = []

    async def main():
        tail = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, tail.set_result, None)
        await collect(Stream([chunk(1), chunk(2, 3), chunk(4)], [0.0, 0.1, 0.01]), tail, 1.0, got)
    with pytest.raises(Unavailable, match=r"closed the stream after 5 token\(s\)"):
        asyncio.run(main())
    assert got == [[1], [2, 3], [4]]


def test_a_quiet_stream_after_the_handoff_is_stalled_at_the_progress_deadline():
    async def main():
        t0 = time.monotonic()
        with pytest.raises(DecodeStalled, match=r"dec-1:9 sent no token for 0.2 s after 3 token\(s\)"):
            await collect(Stream([chunk(1), chunk(2)], [0.0, 0.15], then_silent=True), done_tail(), 0.2)
        return time.monotonic() - t0
    waited = asyncio.run(main())
    assert 0.35 <= waited < 2.0  # 0.15 s to the 2nd token (within the deadline), then 0.2 s of silence


def test_a_quiet_stream_while_the_handoff_runs_is_stalled_too():
    async def main():
        tail = asyncio.get_running_loop().create_future()
        with pytest.raises(DecodeStalled, match="after 1 token"):
            await collect(Stream([], [], then_silent=True), tail, 0.2)
    asyncio.run(main())


def test_a_failed_handoff_ends_the_stream_with_its_error():
    async def main():
        tail = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, tail.set_exception, Unavailable("handoff to dec-1 failed"))
        with pytest.raises(Unavailable, match="handoff to dec-1 failed"):
            await collect(Stream([], [], then_silent=True), tail, 5.0)
    asyncio.run(main())


def test_every_token_arrives_after_the_handoff_with_no_deadline():
    async def main():
        got = []
        with pytest.raises(Unavailable):
            async for c in decode_chunks(Stream([chunk(i) for i in range(50)], [0.0] * 50), done_tail(), "d", 0, None):
                got.extend(c.token_ids)
        return got
    assert asyncio.run(main()) == list(range(50))
