"""The SDK: SDK arguments -> GenerateRequest, status codes -> typed errors, and streams against
an in-process fake gateway (cancel on break, results assembled from chunks)."""
from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
import wave
from concurrent import futures

import grpc
import numpy as np
import pytest
from PIL import Image

import easerve
from easerve.client import AsyncClient, Client, Completion, from_rpc_error
from easerve.errors import (Cancelled, DeadlineExceeded, EAServeError, Internal, InvalidRequest, NotFound, Overloaded,
                            Unavailable)
from easerve.client_request import build_request
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import gateway_pb2 as gpb
from easerve.wire.v1 import gateway_pb2_grpc


def _png(color=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(buf, format="PNG")
    return buf.getvalue()


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\0\0" * 160)
    return buf.getvalue()


# ---- requests ------------------------------------------------------------------------------------
def test_prompt_becomes_a_user_message_media_first(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(_png())
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    req = build_request("what?", images=[_png(), Image.new("RGB", (2, 2)), str(path), uri],
                        audio=(np.zeros(8, np.float64), 16000), max_tokens=5, temperature=0.5, top_p=0.9,
                        top_k=3, seed=7, stop="END", stop_token_ids=[2], request_id="r1", model="m")
    assert req.model == "m" and req.request_id == "r1" and not req.prompt
    (msg,) = req.messages
    kinds = [p.WhichOneof("part") for p in msg.content]
    assert msg.role == "user" and kinds == ["image"] * 4 + ["audio", "text"]
    assert msg.content[0].image.data == _png() and msg.content[2].image.data == _png()
    assert Image.open(io.BytesIO(msg.content[1].image.data)).size == (2, 2)
    assert msg.content[3].image.url == uri
    s = msg.content[4].audio.samples
    assert s.sample_rate == 16000 and np.frombuffer(s.f32le, "<f4").shape == (8,)
    assert msg.content[5].text == "what?"
    sp = req.sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop), list(sp.stop_token_ids)) == (5, 3, 7, ["END"], [2])
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)


def test_video_forms_and_single_image():
    frames = build_request("v", video=[_png(), Image.new("RGB", (2, 2))], video_fps=2.0).messages[0].content[0].video
    assert len(frames.frames.frames) == 2 and frames.fps == 2.0
    assert build_request("v", video=b"GIF89a...").messages[0].content[0].video.file == b"GIF89a..."
    arr = np.zeros((3, 2, 2, 3), np.uint8)
    assert len(build_request("v", video=arr).messages[0].content[0].video.frames.frames) == 3
    assert build_request("i", images=_png()).messages[0].content[0].image.data == _png()
    assert not build_request("plain").sampling.HasField("seed")


def test_raw_prompt_keeps_placeholders_and_media():
    req = build_request(raw_prompt="<image> hi", images=[_png()], audio=_wav())
    assert req.prompt == "<image> hi" and not req.messages
    assert [p.WhichOneof("part") for p in req.media] == ["image", "audio"] and req.media[1].audio.wav == _wav()


def test_openai_style_messages():
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav()).decode(),
                                                                                 "format": "wav"}},
                                         {"type": "image", "image": _png()}]}]
    req = build_request(messages=msgs)
    assert [m.role for m in req.messages] == ["system", "user"]
    assert [p.WhichOneof("part") for p in req.messages[1].content] == ["text", "image", "audio", "image"]
    assert req.messages[1].content[1].image.url == uri and req.messages[1].content[2].audio.wav == _wav()


@pytest.mark.parametrize("kwargs, match", [
    ({}, "nothing to generate"),
    ({"prompt": "a", "raw_prompt": "b"}, "only one"),
    ({"messages": [{"role": "user", "content": "x"}], "images": [b"x"]}, "inside the messages"),
    ({"messages": []}, "empty"),
    ({"messages": [{"role": "user"}]}, "'content'"),
    ({"messages": [{"content": [{"type": "pdf"}]}]}, "'type' must be one of"),
    ({"messages": [{"content": [{"type": "image_url"}]}]}, "lacks the key"),
    ({"raw_prompt": ""}, "raw_prompt is empty"),
    ({"prompt": "a", "images": ["/no/such/file.png"]}, "neither an existing file"),
    ({"prompt": "a", "images": ["https://x/y.png"]}, "fetches no URLs"),
    ({"prompt": "a", "images": [3.5]}, "expected bytes"),
    ({"prompt": "a", "video": []}, "empty"),
    ({"prompt": "a", "audio": (np.zeros((2, 2)), 16000)}, "mono"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": -1}, "top_k"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "min_p": 1.5}, "min_p"),
    ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "a", "logit_bias": {5: 200}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
])
def test_bad_arguments_raise_invalid_request(kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        build_request(**kwargs)


def test_vllm_sampling_arguments_cross_the_wire():
    from easerve.types import SamplingParams
    from easerve.wire.sampling_proto import sampling_from_proto

    req = build_request("a", max_tokens=8, temperature=0.5, seed=3, stop_token_ids=[7], presence_penalty=0.5,
                        frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.05, min_tokens=2,
                        logit_bias={9: -100, 4: 2.5})
    assert sampling_from_proto(req.sampling) == SamplingParams(
        max_tokens=8, temperature=0.5, seed=3, stop_token_ids=(7,), presence_penalty=0.5, frequency_penalty=-0.25,
        repetition_penalty=1.2, min_p=0.05, min_tokens=2, logit_bias=((4, 2.5), (9, -100.0)))


# ---- errors --------------------------------------------------------------------------------------
class _Err(grpc.RpcError):
    def __init__(self, code, details="why"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest), (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded), (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded), (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, Internal), (grpc.StatusCode.UNKNOWN, Internal),
    (grpc.StatusCode.PERMISSION_DENIED, Internal),
])
def test_status_codes_map_to_typed_errors(code, cls):
    err = from_rpc_error(_Err(code))
    assert type(err) is cls and isinstance(err, EAServeError) and str(err) == "why"


def test_timings_cross_the_wire_field_by_field():
    """The gateway's typed Timings reach the SDK whole: every field of common.proto's Timings."""
    from dataclasses import fields

    from easerve.types import Timings
    from easerve.wire.sampling_proto import timings_from_proto, timings_to_proto

    assert [f.name for f in fields(Timings)] == [f.name for f in cpb.Timings.DESCRIPTOR.fields]
    values = {"float": lambda i: i + 0.5, "int": lambda i: i + 1, "bool": lambda i: True}
    sent = Timings(**{f.name: values[f.type](i) for i, f in enumerate(fields(Timings))})
    msg = gpb.GenerateResponse()
    timings_to_proto(sent, msg.timings)
    assert timings_from_proto(gpb.GenerateResponse.FromString(msg.SerializeToString()).timings) == sent
    assert Timings(ttft_ms=5.0).merge(Timings(tpot_ms=1.5)) == Timings(ttft_ms=5.0, tpot_ms=1.5)


def test_error_types_are_exported_lazily_and_subclass_builtins():
    assert easerve.OverloadedError is Overloaded and easerve.Client is Client
    assert issubclass(InvalidRequest, ValueError) and issubclass(DeadlineExceeded, TimeoutError)
    with pytest.raises(AttributeError):
        easerve.NoSuchThing  # noqa: B018


# ---- against a fake gateway ------------------------------------------------------------------------
class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams one token per chunk (ids 10, 11, ...); 'fail:CODE' prompts abort with that code."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.requests: list[gpb.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        text = request.messages[0].content[-1].text if request.messages else request.prompt
        if text.startswith("fail:"):
            context.abort(grpc.StatusCode[text[5:]], "fake failure")
        n, finished = request.sampling.max_tokens, False
        try:
            for i in range(n):
                if not context.is_active():  # the client went away before the end
                    return
                last = i == n - 1
                yield gpb.GenerateResponse(
                    request_id=request.request_id or "gen-1", token_ids=[10 + i], text=f"t{i} ",
                    finish_reason=cpb.FINISH_REASON_LENGTH if last else cpb.FINISH_REASON_UNSPECIFIED,
                    usage=cpb.Usage(prompt_tokens=3, completion_tokens=n) if last else None,
                    timings=cpb.Timings(ttft_ms=5.0) if i == 0 else cpb.Timings(tpot_ms=1.5) if last else None)
                time.sleep(0.01 if n < 50 else 0.05)
            finished = True
        finally:  # also when gRPC closes the generator at a yield because the RPC was cancelled
            if not finished:
                self.cancelled.set()

    def ListModels(self, request, context):
        return gpb.ListModelsResponse(models=[gpb.ModelInfo(id="tiny", family="qwen2_5_vl", modalities=["image"],
                                                            max_model_len=512, created=1)])


@pytest.fixture(scope="module")
def gateway():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    fake = FakeGateway()
    gateway_pb2_grpc.add_GatewayServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def test_client_completion_stream_and_models(gateway):
    fake, addr = gateway
    with Client(addr, timeout=10) as c:
        out = c.generate("hi", max_tokens=3, request_id="abc")
        assert isinstance(out, Completion) and out.text == "t0 t1 t2 " and out.token_ids == (10, 11, 12)
        assert out.finish_reason == "length" and out.request_id == "abc"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 3)
        assert out.timings.ttft_ms == 5.0 and out.timings.tpot_ms == 1.5
        chunks = list(c.generate("hi", max_tokens=2, stream=True))
        assert [ch.finish_reason for ch in chunks] == [None, "length"] and chunks[0].usage is None
        assert c.list_models()[0].id == "tiny" and c.list_models()[0].modalities == ("image",)


def test_client_errors_and_break_cancels(gateway):
    fake, addr = gateway
    with Client(addr) as c:
        with pytest.raises(Overloaded, match="fake failure"):
            c.generate("fail:RESOURCE_EXHAUSTED")
        with pytest.raises(InvalidRequest):
            c.generate("fail:INVALID_ARGUMENT", stream=True).__next__()
        with pytest.raises(DeadlineExceeded):
            c.generate("slow", max_tokens=100, timeout=0.2)
        fake.cancelled.clear()
        for _ in c.generate("long", max_tokens=100, stream=True):
            break
        assert fake.cancelled.wait(5), "breaking out of the stream did not cancel the RPC"
    with Client("127.0.0.1:1", timeout=2) as c, pytest.raises(Unavailable):
        c.list_models()


def test_async_client(gateway):
    fake, addr = gateway

    async def main():
        async with AsyncClient(addr, timeout=10) as c:
            out = await c.generate("hi", max_tokens=3)
            assert out.text == "t0 t1 t2 " and out.finish_reason == "length"
            texts = [ch.text async for ch in await c.generate("hi", max_tokens=2, stream=True)]
            assert texts == ["t0 ", "t1 "]
            assert (await c.list_models())[0].family == "qwen2_5_vl"
            with pytest.raises(Unavailable):
                await c.generate("fail:UNAVAILABLE")
            fake.cancelled.clear()
            async with await c.generate("long", max_tokens=100, stream=True) as stream:
                async for _ in stream:
                    break
            assert await asyncio.to_thread(fake.cancelled.wait, 15)

    asyncio.run(main())
