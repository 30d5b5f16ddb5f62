import asyncio
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from easerve.errors import (CacheMiss, Cancelled, CodecError, DeadlineExceeded, InvalidRequest, NotFound, Overloaded,
                            Unavailable)
from easerve.rpc import errors
from easerve.rpc.deadline import Deadline
from easerve.rpc.server import ServerOptions, serve
from easerve.wire.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.support.decode_server import FakeDecode, with_decode_server

ROOT = Path(__file__).resolve().parents[2]


async def _health(ch, service=""):
    stub = health_pb2_grpc.HealthStub(ch)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def test_health_not_serving_until_warmup_done():
    async def main():
        release = asyncio.Event()

        async def warmup():
            await release.wait()

        async def check(ch, _):
            NS, S = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
            assert await _health(ch) == NS
            assert await _health(ch, "easerve.v1.Decode") == NS
            release.set()
            for _ in range(200):
                if await _health(ch, "easerve.v1.Decode") == S:
                    break
                await asyncio.sleep(0.01)
            assert await _health(ch) == S and await _health(ch, "easerve.v1.Decode") == S
        await with_decode_server(check, warmup=warmup)
    asyncio.run(main())


@pytest.mark.parametrize("exc, code", [
    (ValueError("an internal bug"), grpc.StatusCode.INTERNAL),  # only InvalidRequest blames the caller
    (CodecError("truncated: 3 bytes"), grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest("bad image"), grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable("no prefill"), grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (asyncio.TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotFound("no such request"), grpc.StatusCode.NOT_FOUND),
    (Cancelled("client went away"), grpc.StatusCode.CANCELLED),
    (RuntimeError("secret detail"), grpc.StatusCode.INTERNAL),
])
def test_error_mapping_over_grpc(exc, code):
    async def call(ch, servicer):
        servicer.raise_ = exc
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)
        assert ei.value.code() == code
        if code == grpc.StatusCode.INTERNAL:
            assert "secret" not in ei.value.details()
        back = errors.from_rpc_error(ei.value)
        assert errors.status_code(back) == code and errors.http_status(back) == back.http
    asyncio.run(with_decode_server(call))


def test_streaming_error_after_first_chunk_and_deadline_passed_on():
    async def call(ch, servicer):
        stub = decode_pb2_grpc.DecodeStub(ch)
        req = decode_pb2.ReserveRequest(meta=common_pb2.RequestMeta(request_id="r1"))
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for chunk in stub.Open(req, timeout=5):
                got.append(list(chunk.token_ids))
        assert got == [[1]] and ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stub.Stats(decode_pb2.StatsRequest(), timeout=3)
        assert 2 < servicer.seen_timeout <= 3.1
        await stub.Stats(decode_pb2.StatsRequest())
        assert servicer.seen_timeout is None
    asyncio.run(with_decode_server(call))


def test_http_status_table():
    assert [errors.http_status(e) for e in (
        InvalidRequest("x"), Overloaded(), Unavailable(), DeadlineExceeded(),
        NotFound(), KeyError("k"), ValueError("a bug"))] == [400, 429, 503, 504, 404, 500, 500]


def test_deadline_value_type():
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    d = Deadline.after(2.0, clock)
    assert d.remaining(clock) == 2.0 and d.to_ms(clock) == 2000 and d.timeout(clock=clock) == 2.0
    assert Deadline.from_ms(500, clock).earliest(d) == Deadline(100.5)
    assert Deadline.from_ms(0, clock) == Deadline.none() and Deadline.none().timeout() is None
    assert Deadline.none().to_ms() == 0 and Deadline.none().remaining() == math.inf
    now[0] = 101.999
    assert d.timeout(floor_s=0.05, clock=clock) == 0.05
    now[0] = 102.5
    assert d.expired(clock)
    with pytest.raises(DeadlineExceeded, match="500.0 ms ago"):
        d.timeout(clock=clock)
    with pytest.raises(ValueError):
        Deadline(float("nan"))


def test_server_options_validate():
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerOptions(max_message_bytes=10)
    with pytest.raises(ValueError, match="grace_s"):
        ServerOptions(grace_s=-1)


SERVER_APP = textwrap.dedent("""
    import asyncio, sys
    from easerve.rpc.server import run, serve
    from easerve.wire.v1 import common_pb2, decode_pb2_grpc

    class Slow(decode_pb2_grpc.DecodeServicer):
        async def Open(self, request, context):
            for i in range(6):
                yield common_pb2.TokenChunk(request_id=request.meta.request_id, token_ids=[i])
                await asyncio.sleep(0.15)

    def bound(port):
        print(port, flush=True)

    run(serve([(decode_pb2_grpc.add_DecodeServicer_to_server, Slow())], "127.0.0.1:0",
              health_services=["easerve.v1.Decode"], grace_s=5.0, on_bound=bound))
    print("exited cleanly", flush=True)
""")


def test_sigterm_drains_inflight_stream_then_exits_zero(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(SERVER_APP)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        port = int(proc.stdout.readline())

        async def client():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                req = decode_pb2.ReserveRequest(meta=common_pb2.RequestMeta(request_id="r"))
                got = []
                async for chunk in stub.Open(req, timeout=10):
                    got.extend(chunk.token_ids)
                    if len(got) == 1:
                        proc.send_signal(signal.SIGTERM)
                        await asyncio.sleep(0.1)
                        with pytest.raises(grpc.aio.AioRpcError):  # new calls are refused
                            await stub.Open(req, timeout=2).read()
                return got
        t0 = time.monotonic()
        assert asyncio.run(client()) == list(range(6))
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
        assert proc.stdout.read().strip() == "exited cleanly"
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unparseable_request_bytes_are_invalid_argument_and_the_server_keeps_serving():
    async def call(ch, servicer):
        codes = []
        for method, streamed in (("/easerve.v1.Decode/Stats", False), ("/easerve.v1.Decode/Open", True)):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                if streamed:
                    [m async for m in ch.unary_stream(method)(b"\x0a\xff\xff", timeout=5)]
                else:
                    await ch.unary_unary(method)(b"\x0a\xff\xff", timeout=5)
            codes.append((ei.value.code(), ei.value.details()))
        assert all(c == grpc.StatusCode.INVALID_ARGUMENT for c, _ in codes), codes
        assert "easerve.v1.StatsRequest" in codes[0][1] and "easerve.v1.ReserveRequest" in codes[1][1]
        assert (await decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)).running == 1
    asyncio.run(with_decode_server(call))


def test_an_error_named_where_it_came_from_keeps_its_class_and_retry_hint():
    from easerve.errors import MessageTooLarge

    err = Overloaded("queue full", retry_after_s=3.5).where("easerve.v1.Encode at 127.0.0.1:1")
    assert type(err) is Overloaded and err.retry_after_s == 3.5
    assert str(err) == "easerve.v1.Encode at 127.0.0.1:1: queue full"
    assert type(MessageTooLarge("big").where("x")) is MessageTooLarge


def test_an_encoder_cache_miss_is_known_by_its_reason_code_not_its_words():
    """A CacheMiss crosses gRPC as NOT_FOUND + trailing metadata `easerve-reason`, and comes
    back a CacheMiss however its message is worded or prefixed; a NotFound whose message
    reads like a miss is not one."""
    async def back_from(ch, servicer, exc):
        servicer.raise_ = exc
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        return ei.value, errors.from_rpc_error(ei.value)

    async def call(ch, servicer):
        rpc, miss = await back_from(ch, servicer, CacheMiss("the instance was restarted; nothing here"))
        assert dict(rpc.trailing_metadata())[errors.REASON_KEY] == "ENCODER_CACHE_MISS"
        named = miss.where("easerve.v1.Encode at 127.0.0.1:1")   # as Peers.start_call names the instance
        assert type(miss) is CacheMiss and type(named) is CacheMiss
        assert str(named) == "easerve.v1.Encode at 127.0.0.1:1: the instance was restarted; nothing here"
        _, look_alike = await back_from(ch, servicer, NotFound(
            "encoder cache miss: item 0 (image) is not held by this encode instance; resend the item with its inputs"))
        assert type(look_alike) is NotFound and not isinstance(look_alike, CacheMiss)
    asyncio.run(with_decode_server(call))


class Queued(decode_pb2_grpc.DecodeServicer):
    """Open streams 4 tokens `step_s` apart (a call accepted behind a queue); Stats answers."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    async def Open(self, request, context):
        for i in range(4):
            await asyncio.sleep(self.step_s)
            yield common_pb2.TokenChunk(request_id=request.meta.request_id, token_ids=[i])

    async def Stats(self, request, context):
        return decode_pb2.StatsResponse(running=1)


async def _draining_server(servicer, options=ServerOptions(), **kw):
    stop, ports = asyncio.Event(), []
    task = asyncio.create_task(serve([(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)], "127.0.0.1:0",
                                     health_services=["easerve.v1.Decode"], stop=stop, on_bound=ports.append,
                                     options=options, **kw))
    while not ports:
        await asyncio.sleep(0.01)
    return task, stop, ports[0]


def test_the_drain_refuses_new_calls_unavailable_and_lets_accepted_ones_finish_past_the_grace_time():
    """grace 0.1 s, three streams accepted that need ~1.2 s more: all three finish whole;
    meanwhile health is NOT_SERVING, a new Open is refused UNAVAILABLE (its caller retries
    elsewhere), an allowed method is still answered, and serve() returns only after them."""
    async def main():
        task, stop, port = await _draining_server(Queued(0.3), grace_s=0.1,
                                                  drain_allows=["/easerve.v1.Decode/Stats"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)

            async def tokens(rid):
                req = decode_pb2.ReserveRequest(meta=common_pb2.RequestMeta(request_id=rid))
                return [t async for c in stub.Open(req, timeout=30) for t in c.token_ids]
            calls = [asyncio.ensure_future(tokens(f"r{i}")) for i in range(3)]
            await asyncio.sleep(0.2)  # accepted, none finished
            stop.set()
            await asyncio.sleep(0.1)
            assert await _health(ch, "easerve.v1.Decode") == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Open(decode_pb2.ReserveRequest(meta=common_pb2.RequestMeta(request_id="late")),
                                timeout=5).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "draining" in refused.value.details()
            assert (await stub.Stats(decode_pb2.StatsRequest(), timeout=5)).running == 1  # allowed
            assert not task.done()
            assert await asyncio.wait_for(asyncio.gather(*calls), 10) == [[0, 1, 2, 3]] * 3
            await asyncio.wait_for(task, 10)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Stats(decode_pb2.StatsRequest(), timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # nothing listens on the port any more
    asyncio.run(main())


def test_a_call_still_open_at_the_drains_bound_ends_unavailable_not_cancelled():
    async def main():
        task, stop, port = await _draining_server(Queued(60.0), options=ServerOptions(drain_timeout_s=0.5),
                                                  grace_s=5.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Open(
                decode_pb2.ReserveRequest(meta=common_pb2.RequestMeta(request_id="r")), timeout=30)
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            stop.set()
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await call.read()
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
            assert "--drain-timeout-s" in cut.value.details()
            await asyncio.wait_for(task, 10)
            assert time.monotonic() - t0 < 4  # the bound, not the 60 s call nor the 5 s grace
    asyncio.run(main())


def test_the_drain_waits_for_settle_and_a_settle_past_the_bound_is_cut_short():
    async def main():
        release = asyncio.Event()

        async def settle():
            await release.wait()
        task, stop, _ = await _draining_server(FakeDecode(), settle=settle)
        stop.set()
        await asyncio.sleep(0.3)
        assert not task.done()
        release.set()
        await asyncio.wait_for(task, 5)

        task, stop, _ = await _draining_server(FakeDecode(), options=ServerOptions(drain_timeout_s=0.3),
                                               settle=lambda: asyncio.sleep(60))
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - t0 < 5
    asyncio.run(main())


def test_a_cancelled_status_from_a_peer_is_unavailable_to_its_caller():
    class Cut(grpc.aio.AioRpcError):
        def __init__(self):
            super().__init__(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Cancelled")
    err = errors.from_peer_error(Cut())
    assert type(err) is Unavailable and "retry it elsewhere" in str(err)
    assert type(errors.from_rpc_error(Cut())) is Cancelled


def test_freeze_startup_heap_moves_every_live_object_out_of_the_collector():
    import gc

    from easerve.rpc.server import freeze_startup_heap
    class Box:
        pass
    keep = [Box() for _ in range(50_000)]  # live objects made "at start-up"
    try:
        frozen = freeze_startup_heap()
        # (the count itself moves: frozen objects freed later leave it, other threads allocate)
        assert frozen > len(keep)
        scanned = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
        assert not any(id(b) in scanned for b in keep)  # no collection walks them any more
        later = Box()
        assert id(later) in {id(o) for o in gc.get_objects(generation=0)}  # what comes after still is
    finally:
        gc.unfreeze()
