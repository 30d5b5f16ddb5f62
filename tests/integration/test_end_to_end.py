"""Each modality end to end through real processes, via the SDK and the openai package,
streaming and not: greedy output equals the in-process runtime's on the same checkpoint."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from easerve import Client
from easerve.media import decode_audio
from easerve.pipeline import InProcessPipeline
from easerve.types import SamplingParams
from tests.support.media import data_uri, png_bytes, wav_bytes
from tests.support.prom import metric, scrape

pytestmark = pytest.mark.slow
PROMPT = "What is this?"
N = 8


def reference(model: str, parts: list[dict]) -> list[int]:
    pipe = InProcessPipeline(model)
    msgs = [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]
    return pipe.run([(msgs, SamplingParams(max_tokens=N))])[0].token_ids


def _frames(seed: int, n: int) -> list[bytes]:
    return [png_bytes(56, 56, seed + i) for i in range(n)]


def test_image_and_video_through_sdk(vl_stack):
    model = vl_stack.deployment.model
    client = Client(vl_stack.endpoints.grpc, timeout=120)
    for k in range(2):  # two requests: the deficit router sends one local, one remote (s = 0.5)
        img = png_bytes(60, 90, seed=k)
        got = client.generate(PROMPT, images=[img], max_tokens=N)
        want = reference(model, [{"type": "image", "image": Image.open(io.BytesIO(img)).convert("RGB")}])
        assert list(got.token_ids) == want
        assert got.usage.completion_tokens == len(want)
        assert got.finish_reason == ("length" if len(want) == N else "stop")
    frames = _frames(7, 4)
    chunks = list(client.generate(PROMPT, video=frames, max_tokens=N, stream=True))
    streamed = [t for c in chunks for t in c.token_ids]
    video = [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]
    assert streamed == reference(model, [{"type": "video", "video": video}])
    assert chunks[-1].finish_reason in ("length", "stop")


def test_image_through_openai_package(vl_stack):
    from openai import OpenAI

    model = vl_stack.deployment.model
    oa = OpenAI(base_url=vl_stack.endpoints.openai_base_url, api_key="none", max_retries=0)
    served = oa.models.list().data[0].id
    img = png_bytes(48, 80, seed=11)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(img)}},
                                         {"type": "text", "text": PROMPT}]}]
    tok = InProcessPipeline(model).lm.tokenizer
    want = reference(model, [{"type": "image", "image": Image.open(io.BytesIO(img)).convert("RGB")}])
    want_text = tok.decode(want, skip_special_tokens=True)
    r = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want_text
    assert r.usage.completion_tokens == len(want)
    stream = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want_text


def test_audio_through_sdk_and_openai(audio_stack):
    from openai import OpenAI
    import base64

    model = audio_stack.deployment.model
    wav = wav_bytes(0.8, 440)
    samples = decode_audio(wav, target_rate=16000)
    want = reference(model, [{"type": "audio", "audio": samples}])
    got = Client(audio_stack.endpoints.grpc, timeout=120).generate(PROMPT, audio=wav, max_tokens=N)
    assert list(got.token_ids) == want
    oa = OpenAI(base_url=audio_stack.endpoints.openai_base_url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": PROMPT}]}]
    served = oa.models.list().data[0].id
    stream = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    tok = InProcessPipeline(model).lm.tokenizer
    assert text == tok.decode(want, skip_special_tokens=True)


def test_text_only_skips_encode(vl_stack):
    import json
    import urllib.request

    before = _encode_batches(vl_stack)
    got = Client(vl_stack.endpoints.grpc, timeout=60).generate("Hello there", max_tokens=4)
    assert 1 <= got.usage.completion_tokens <= 4
    assert _encode_batches(vl_stack) == before
    body = json.loads(urllib.request.urlopen(vl_stack.endpoints.http + "/v1/models", timeout=10).read())
    assert body["data"][0]["id"]


def _encode_batches(stack) -> float:
    return metric(scrape(stack.endpoints.http + "/metrics"), "easerve:stage_latency_seconds_count", stage="encode")
