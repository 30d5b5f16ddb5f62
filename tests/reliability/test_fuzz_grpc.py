"""Fuzzing the gateway's gRPC API (easerve.v1.Gateway/Generate) of a live stack with seeded
hypothesis strategies: unparseable and wire-type-confused bytes, invalid UTF-8 strings, deep
nesting, bad numbers (NaN / infinite / negative / huge), broken base64, truncated / mistyped /
empty / oversize media, bad structure and over-long prompts. Each must end INVALID_ARGUMENT with
details saying what to change; no process may crash or restart; valid requests still succeed.

    EASERVE_TINY_CACHE=/tmp/tiny pytest -q -m slow tests/reliability/test_fuzz_grpc.py -s
"""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import gateway_pb2 as gpb
from tests.support.media import png_bytes
from tests.reliability.fuzz_cases import fuzz, MP4, PNG, WAV, Tally, broken_base64, corrupted, data_uri, truncated

pytestmark = [pytest.mark.slow, pytest.mark.load]  # hundreds of requests: a long load test
TALLY = Tally()
GENERATE = "/easerve.v1.Gateway/Generate"


class _Target:
    def __init__(self, stack):
        self.stack, self.pids = stack, dict(stack.pids)
        self.channel = grpc.insecure_channel(stack.endpoints.grpc)
        self.call = self.channel.unary_stream(GENERATE)  # raw bytes in, raw bytes out

    def refused(self, family: str, raw: bytes | gpb.GenerateRequest) -> None:
        if isinstance(raw, gpb.GenerateRequest):
            raw = raw.SerializeToString()
        try:
            got = list(self.call(raw, timeout=60))
        except grpc.RpcError as e:
            TALLY.add(family, e.code().name)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{family}: {e.code()} {e.details()} for {raw[:200]!r}"
            assert e.details() and e.details().strip()
            return
        TALLY.add(family, "OK")
        raise AssertionError(f"{family}: accepted ({len(got)} messages) {raw[:200]!r}")

    def ok(self, req: gpb.GenerateRequest) -> list[gpb.GenerateResponse]:
        out = [gpb.GenerateResponse.FromString(m) for m in self.call(req.SerializeToString(), timeout=120)]
        assert out and out[-1].finish_reason != cpb.FINISH_REASON_UNSPECIFIED
        return out


@pytest.fixture(scope="module")
def vl(fuzz_vl):
    t = _Target(fuzz_vl)
    yield t
    t.channel.close()


@pytest.fixture(scope="module")
def audio(fuzz_audio):
    t = _Target(fuzz_audio)
    yield t
    t.channel.close()


def sampling(**kw) -> cpb.SamplingParams:
    return cpb.SamplingParams(max_tokens=kw.pop("max_tokens", 2), **kw)


def text_req(**sp) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(prompt="hello", sampling=sampling(**sp))


def media_req(part: gpb.ContentPart) -> gpb.GenerateRequest:
    msg = gpb.ChatMessage(role="user", content=[gpb.ContentPart(text="What is this?"), part])
    return gpb.GenerateRequest(messages=[msg], sampling=sampling())


def image(**src) -> gpb.ContentPart:
    return gpb.ContentPart(image=gpb.ImageInput(**src))


def video(**src) -> gpb.ContentPart:
    return gpb.ContentPart(video=gpb.VideoInput(**src))


def audio_part(**src) -> gpb.ContentPart:
    return gpb.ContentPart(audio=gpb.AudioInput(**src))


# ---- raw wire bytes ---------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(num: int, wire: int, payload: bytes = b"") -> bytes:
    return varint(num << 3 | wire) + payload


def ld(num: int, body: bytes) -> bytes:  # length-delimited
    return field(num, 2, varint(len(body)) + body)


VALID = media_req(image(data=PNG)).SerializeToString()
unparseable = st.one_of(
    st.integers(1, len(VALID) - 1).map(lambda n: VALID[:n]).filter(lambda b: _fails(b)),  # cut mid-field
    st.binary(min_size=1, max_size=300).filter(lambda b: _fails(b)),
    st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x1a\x05ab", b"\x07", b"\x0b\x0c"]),
)
# a valid tag with the wrong wire type: sampling (5, a message) sent as a varint, prompt (3) as fixed64, ...
wire_confused = st.sampled_from([field(5, 0, varint(7)), field(3, 1, b"\x00" * 8), field(2, 5, b"\x00" * 4),
                                 ld(5, field(1, 2, varint(1) + b"x")), ld(5, field(2, 2, b"\x01x")),
                                 ld(2, ld(2, field(1, 0, varint(1)))), field(6, 0, varint(1))])


def _fails(raw: bytes) -> bool:
    try:
        gpb.GenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - only the bytes protobuf itself refuses are wanted here
        return True
    return False


def nest(depth: int, where: int) -> bytes:
    """`depth` nested groups of an unknown field (past protobuf's recursion limit of 100), at the
    top level or inside the sampling message. (Nested length-delimited unknown fields are not
    nesting: they are skipped whole, rightly.)"""
    groups = field(99, 3) * depth + field(99, 4) * depth
    return ld(3, b"hi") + (groups if where == 0 else ld(5, field(1, 0, varint(2)) + groups))


def bad_utf8(bad: bytes) -> st.SearchStrategy:
    return st.sampled_from([ld(3, b"hi" + bad), ld(1, bad),  # prompt, model
                            ld(2, ld(1, b"us" + bad) + ld(2, ld(1, b"x"))),  # a message's role
                            ld(2, ld(2, ld(1, b"x" + bad)) + ld(1, b"user")),  # a text part
                            ld(3, b"hi") + ld(5, field(1, 0, varint(2)) + ld(6, bad))])  # a stop string


# ---- tests ------------------------------------------------------------------------------------
@fuzz(150)
@given(unparseable)
def test_unparseable_bytes(vl, raw):
    vl.refused("unparseable protobuf", raw)


@fuzz(20)
@given(wire_confused)
def test_wrong_wire_types(vl, raw):
    vl.refused("wrong types (wire type)", raw)


@fuzz(30)
@given(st.integers(101, 20_000), st.sampled_from([0, 1]))
def test_deep_nesting(vl, depth, where):
    vl.refused("deep nesting", nest(depth, where))


@fuzz(40)
@given(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80", b"\xc0\xaf", b"\x80",
                        b"\xe2\x82", b"\xf4\x90\x80\x80"]).flatmap(bad_utf8))
def test_invalid_utf8(vl, raw):
    vl.refused("invalid unicode", raw)


NAN = [math.nan, math.inf, -math.inf]
BAD_SAMPLING = ([{"temperature": v} for v in (*NAN, -0.5, -1e30)] + [{"top_p": v} for v in (*NAN, -0.1, 1.5)]
                + [{"max_tokens": v} for v in (1000, 2 ** 32 - 1)] + [{"logprobs": v} for v in (21, 2 ** 32 - 1)]
                + [{"stop": [""]}, {"stop": ["ok", ""]}])


F32 = {"allow_nan": False, "allow_infinity": False, "width": 32}
bad_sampling = st.one_of(
    st.sampled_from(BAD_SAMPLING),
    st.floats(max_value=-0.0625, **F32).map(lambda v: {"temperature": v}),
    st.floats(min_value=1.0625, **F32).map(lambda v: {"top_p": v}),
    st.floats(max_value=-0.0625, **F32).map(lambda v: {"top_p": v}),
    st.integers(520, 2 ** 32 - 1).map(lambda v: {"max_tokens": v}),
    st.integers(21, 2 ** 32 - 1).map(lambda v: {"logprobs": v}),
)


@fuzz(100)
@given(bad_sampling, st.sampled_from(["prompt", "messages"]))
def test_bad_numbers(vl, sp, shape):
    req = text_req(**sp)
    if shape == "messages":
        req = gpb.GenerateRequest(messages=[gpb.ChatMessage(role="user", content=[gpb.ContentPart(text="hi")])],
                                  sampling=req.sampling)
    vl.refused("huge / negative / NaN numbers", req)


@fuzz(20)
@given(st.sampled_from([*NAN, -1.0, -1e9]))
def test_bad_video_fps(vl, fps):
    vl.refused("huge / negative / NaN numbers", media_req(video(file=MP4, fps=fps)))


@fuzz(20)
@given(st.sampled_from([0, 1, 2 ** 31, 2 ** 32 - 1]), st.sampled_from(["nan", "inf", "ok"]))
def test_bad_audio_samples(audio, rate, values):
    x = np.full(1600, {"nan": np.nan, "inf": np.inf, "ok": 0.1}[values], dtype="<f4")
    if values == "ok" and 8000 <= rate <= 10 ** 6:  # a valid clip: not for this test
        rate = 0
    audio.refused("huge / negative / NaN numbers",
                  media_req(audio_part(samples=gpb.AudioSamples(f32le=x.tobytes(), sample_rate=rate))))


@fuzz(40)
@given(broken_base64, st.sampled_from(["image", "video"]))
def test_broken_base64(vl, value, kind):
    vl.refused("broken base64", media_req(image(url=value) if kind == "image" else video(url=value)))


@fuzz(20)
@given(broken_base64)
def test_broken_base64_audio(audio, value):
    audio.refused("broken base64", media_req(audio_part(url=value)))


@fuzz(60)
@given(st.one_of(truncated("png").map(lambda b: image(data=b)), truncated("mp4").map(lambda b: video(file=b)),
                 corrupted("png").map(lambda b: image(data=b)), corrupted("mp4").map(lambda b: video(file=b)),
                 truncated("png").map(lambda b: video(frames=gpb.VideoFrames(frames=[PNG, b])))))
def test_truncated_media(vl, part):
    vl.refused("truncated / corrupted media", media_req(part))


@fuzz(20)
@given(truncated("wav"))
def test_truncated_audio(audio, raw):
    audio.refused("truncated / corrupted media", media_req(audio_part(wav=raw)))


@fuzz(20)
@given(st.sampled_from([image(data=WAV), image(data=MP4), image(url=data_uri(WAV, "image/png")),
                        image(data=b"%PDF-1.4"), video(file=WAV), video(file=b"plain text"),
                        video(url=data_uri(WAV, "video/mp4")), video(frames=gpb.VideoFrames(frames=[WAV]))]))
def test_wrong_mime(vl, part):
    vl.refused("wrong MIME types", media_req(part))


@fuzz(10)
@given(st.sampled_from([audio_part(wav=PNG), audio_part(wav=MP4), audio_part(url=data_uri(PNG, "audio/wav")),
                        audio_part(wav=b"RIFF\x00\x00\x00\x00WAVE")]))
def test_wrong_mime_audio(audio, part):
    audio.refused("wrong MIME types", media_req(part))


BIG_SIDE = png_bytes(1, 9000, 3)
EMPTY = [image(data=b""), image(url=""), image(url="data:image/png;base64,"), gpb.ContentPart(image=gpb.ImageInput()),
         video(file=b""), video(frames=gpb.VideoFrames()), video(frames=gpb.VideoFrames(frames=[b""])),
         gpb.ContentPart(video=gpb.VideoInput(fps=2)), gpb.ContentPart()]
OVERSIZE = [image(data=BIG_SIDE), video(frames=gpb.VideoFrames(frames=[BIG_SIDE])),
            image(url=data_uri(BIG_SIDE, "image/png"))]


@fuzz(30)
@given(st.sampled_from([("empty media", p) for p in EMPTY] + [("oversize media", p) for p in OVERSIZE]))
def test_empty_and_oversize_media(vl, case):
    vl.refused(case[0], media_req(case[1]))


@fuzz(10)
@given(st.sampled_from([audio_part(wav=b""), audio_part(url=""), gpb.ContentPart(audio=gpb.AudioInput()),
                        audio_part(samples=gpb.AudioSamples(f32le=b"", sample_rate=16000)),
                        audio_part(samples=gpb.AudioSamples(f32le=b"\x00" * 7, sample_rate=16000)),
                        image(data=PNG)]))  # an image to an audio-only model
def test_empty_audio(audio, part):
    audio.refused("empty media", media_req(part))


STRUCTURE = [gpb.GenerateRequest(), gpb.GenerateRequest(sampling=sampling()),
             gpb.GenerateRequest(prompt="hi", messages=[gpb.ChatMessage(role="user", content=[gpb.ContentPart(text="x")])]),
             gpb.GenerateRequest(prompt="hi", model="not-this-model"),
             gpb.GenerateRequest(messages=[gpb.ChatMessage(role="robot", content=[gpb.ContentPart(text="x")])]),
             gpb.GenerateRequest(messages=[gpb.ChatMessage(role="user")]),
             gpb.GenerateRequest(prompt="<|vision_start|><|image_pad|><|vision_end|> what?"),  # a placeholder, no image
             gpb.GenerateRequest(prompt="hi", media=[image(data=PNG)]),  # media without its placeholder
             gpb.GenerateRequest(prompt="hi", media=[gpb.ContentPart(text="x")]),
             gpb.GenerateRequest(messages=[gpb.ChatMessage(role="user", content=[audio_part(wav=WAV)])])]


@fuzz(30)
@given(st.sampled_from(STRUCTURE))
def test_bad_structure(vl, req):
    vl.refused("wrong types (structure)", req)


@fuzz(40)
@given(st.one_of(st.integers(600, 3000).map(lambda n: gpb.GenerateRequest(prompt="word " * n, sampling=sampling())),
                 st.integers(600, 2000).map(lambda n: gpb.GenerateRequest(
                     messages=[gpb.ChatMessage(role="user", content=[gpb.ContentPart(text="hello " * n)])])),
                 st.integers(520, 2 ** 32 - 1).map(lambda n: text_req(max_tokens=n))))
def test_long_prompts(vl, req):
    vl.refused("over-long prompts", req)


# ---- afterwards ---------------------------------------------------------------------------------
def test_zz_valid_requests_after_and_nothing_restarted(vl, audio):
    out = vl.ok(media_req(image(data=PNG)))
    assert out[-1].usage.completion_tokens >= 1
    assert vl.ok(text_req(max_tokens=3))[-1].usage.completion_tokens >= 1
    assert vl.ok(media_req(video(file=MP4)))
    assert audio.ok(media_req(audio_part(wav=WAV)))
    for t in (vl, audio):
        assert t.stack.pids == t.pids and set(t.stack.restarts.values()) == {0}
    print(f"\ngRPC fuzz, requests and statuses per family:\n{TALLY.table()}")
    assert TALLY.total >= 500
