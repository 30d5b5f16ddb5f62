"""An encode instance that dies mid-call after its KV reached decode (kill -9 between the
handoff and the first token's reply) leaves the gateway a reservation already used: decode
decodes, or has finished, the request whose first token never came back. The gateway's retry
on the other encode instance must not reuse that reservation (its handoff would be refused:
NOT_FOUND once decode finished it, INVALID_ARGUMENT while it runs); it opens a new one under
a new internal id, and the client gets its answer. With no other instance to try, a refusal
is answered as it is (RESOURCE_EXHAUSTED), without opening a second reservation.

The gateway (real GatewayCore and gRPC front, tiny processor) and decode (the real engine,
servicer and KV receiver on the tiny model) are the product's; the two encode instances are
scripted: each hands a real KV payload (inline codec bytes) to the decode instance the
request names, as a prefill does, and the first call of all then fails UNAVAILABLE, as a
killed process does, after decode has finished that request."""
from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import pytest

from tests.support.media import png_bytes

SERVED = "tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from easerve.models.tiny import cached_tiny
    return cached_tiny("qwen2.5-vl", os.environ.get("EASERVE_TINY_CACHE") or tmp_path_factory.mktemp("tiny"))


class ScriptedEncode:
    """An encode instance's part in the handoff: send the KV to the named decode instance,
    then answer the first token, or (the first call of all) fail UNAVAILABLE once decode
    has finished the request."""

    def __init__(self, name: str, script: dict, payload, decode_engine, refuses: bool = False):
        self.name, self.script, self.payload, self.decode_engine = name, script, payload, decode_engine
        self.refuses = refuses  # answer every call RESOURCE_EXHAUSTED at once, as a full queue does

    def servicer(self):
        from easerve.rpc.errors import from_rpc_error, grpc_errors
        from easerve.wire.codec import join_parts, kv_to_parts
        from easerve.wire.protoconv import token_chunk
        from easerve.wire.v1 import common_pb2 as cpb
        from easerve.wire.v1 import decode_pb2, decode_pb2_grpc, encode_pb2_grpc, kv_pb2

        me = self

        class Servicer(encode_pb2_grpc.EncodeServicer):
            @grpc_errors
            async def Encode(self, request, context):
                rid = request.meta.request_id
                dies = not me.script["calls"]
                me.script["calls"].append((me.name, rid))
                if me.refuses:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the encode queue is full; retry later")
                kv = dataclasses.replace(me.payload, request_id=rid)
                msg = kv_pb2.KVTransfer(request_id=rid, inline=join_parts(*kv_to_parts(kv)))
                async with grpc.aio.insecure_channel(request.decode.address) as ch:
                    try:
                        await decode_pb2_grpc.DecodeStub(ch).Submit(
                            decode_pb2.DecodeRequest(meta=cpb.RequestMeta(request_id=rid), kv=msg), timeout=10)
                    except grpc.aio.AioRpcError as e:
                        raise from_rpc_error(e) from None
                if dies:  # decode runs the request to its end; then this process "dies"
                    while me.decode_engine.num_streams:
                        await asyncio.sleep(0.01)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed (the process was killed)")
                yield token_chunk(rid, [kv.first_token], None, text="a", encode_ms=1.0)
        return Servicer()


async def _server(adders, stage: str, load):
    from easerve.rpc.server import serve
    from easerve.stages.common import load as stage_load
    from easerve.transport.node import local_identity

    stop, port = asyncio.Event(), asyncio.get_running_loop().create_future()
    adders = [*adders, stage_load.adder(stage_load.StageServicer(stage, local_identity(), load))]
    task = asyncio.create_task(serve(adders, "127.0.0.1:0", health_services=[f"easerve.v1.{stage.title()}"],
                                     stop=stop, on_bound=port.set_result))
    return f"127.0.0.1:{await port}", stop, task


def _generate(model, n_encode: int, refuses: bool = False) -> tuple[list | None, tuple | None, dict]:
    """One image request through the gateway to `n_encode` scripted encode instances and the real
    decode: (its messages, or None; (status, details) of its error, or None; the script: encode
    calls in order, and the reservations decode opened)."""
    from easerve.engine.config import EngineConfig
    from easerve.models.loader import load_adapter
    from easerve.rpc.server import HealthState
    from easerve.stages.common.warmup import dummy_payload
    from easerve.stages.decode.app import build_engine
    from easerve.stages.decode.servicer import DecodeServicer
    from easerve.stages.gateway.core import GatewayConfig, GatewayCore
    from easerve.stages.gateway.metrics import GatewayMetrics
    from easerve.stages.gateway.servicer import GatewayServicer
    from easerve.transport.handoff import KVReceiver
    from easerve.wire.v1 import common_pb2 as cpb
    from easerve.wire.v1 import decode_pb2_grpc, encode_pb2_grpc, gateway_pb2_grpc
    from easerve.wire.v1 import gateway_pb2 as gpb

    lm = load_adapter(str(model), role="decode")
    payload = dummy_payload(lm)
    script = {"calls": [], "opens": []}

    class CountedDecode(DecodeServicer):
        async def Open(self, request, context):
            script["opens"].append(request.meta.request_id)
            async for m in super().Open(request, context):
                yield m

    async def main():
        engine = build_engine(EngineConfig(max_running=4, max_waiting=4, max_seq_len=512), lm, HealthState())
        engine.start()
        dec_addr, dec_stop, dec_task = await _server(
            [(decode_pb2_grpc.add_DecodeServicer_to_server, CountedDecode(engine, KVReceiver(), 4))], "decode",
            lambda: _idle(engine.num_streams))
        encs = [await _server([(encode_pb2_grpc.add_EncodeServicer_to_server,
                                ScriptedEncode(f"encode-{i}", script, payload, engine, refuses).servicer())],
                              "encode", lambda: _idle(0)) for i in range(n_encode)]
        cfg = GatewayConfig(model=str(model), served_model_name=SERVED, encode=tuple(a for a, _, _ in encs),
                            prefill=("127.0.0.1:1",), decode=(dec_addr,), max_model_len=1024)  # no text-only prompt here
        core = GatewayCore(cfg, load_adapter(str(model), role="processor"), GatewayMetrics())
        core.start()
        gw_addr, gw_stop, gw_task = await _server(
            [(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(core))], "gateway", lambda: _idle(0))
        try:
            async with grpc.aio.insecure_channel(gw_addr) as ch:
                msg = gpb.ChatMessage(role="user", content=[
                    gpb.ContentPart(text="what is this?"),
                    gpb.ContentPart(image=gpb.ImageInput(data=png_bytes(56, 56, seed=3)))])
                req = gpb.GenerateRequest(messages=[msg], sampling=cpb.SamplingParams(max_tokens=3, ignore_eos=True))
                try:
                    return [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)], None
                except grpc.aio.AioRpcError as e:
                    return None, (e.code().name, e.details())
        finally:
            for stop in (gw_stop, *(s for _, s, _ in encs), dec_stop):
                stop.set()
            await asyncio.gather(gw_task, *(t for _, _, t in encs), dec_task)
            await core.stop()
            await engine.stop()

    return (*asyncio.run(main()), script)


def test_a_retry_after_an_encode_died_past_its_handoff_gets_a_new_reservation(model):
    out, err, script = _generate(model, 2)
    assert err is None, f"the retried request failed: {err}; encode calls {script['calls']}"
    (first_enc, first_rid), (second_enc, second_rid) = script["calls"]
    assert first_enc != second_enc, "the retry went to the instance that died"
    assert first_rid != second_rid, "the retry reused the reservation (request id) the dead call had filled"
    assert script["opens"] == [first_rid, second_rid]
    tokens = [t for m in out for t in m.token_ids]
    assert len(tokens) == 3 and out[-1].finish_reason, out


def test_a_refusal_with_no_other_instance_is_answered_without_a_second_reservation(model):
    """One encode instance, and it refuses: RESOURCE_EXHAUSTED at once, one reservation opened
    (and freed), no retry: under overload a retry that has nowhere to go would double decode's
    Open calls for every refused request."""
    out, err, script = _generate(model, 1, refuses=True)
    assert out is None and err is not None and err[0] == "RESOURCE_EXHAUSTED", err
    assert [n for n, _ in script["calls"]] == ["encode-0"] and len(script["opens"]) == 1, script


async def _idle(inflight: int):
    from easerve.stages.common import load as stage_load
    return stage_load.Load(inflight, 64)
