"""OpenAI chat schema -> domain request: what is accepted, and what gets a 400 with a reason."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from easerve.media import MediaConfig, MediaRef, MediaResolver
from services.gateway import openai_api as oa

MODALITIES = ("image", "video")


def _png(h=16, w=24) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def parse(body, modalities=MODALITIES, rate=None):
    return oa.parse_chat_request(body, "m", modalities, rate, default_max_tokens=32)


def resolved(req, rate=None):
    """The request's MediaRefs fetched and decoded, as GatewayCore.preprocess does."""
    asyncio.run(MediaResolver(MediaConfig(audio_rate=rate)).resolve_messages(req.messages))
    return req


def test_parts_become_hf_messages_and_sampling_follows_openai_defaults():
    req = parse({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png()}},
                                     {"type": "video_url", "video_url": {"frames": [_png(), _png()]}},
                                     {"type": "text", "text": "what?"}]}],
        "stream": True, "stream_options": {"include_usage": True}, "stop": "END", "seed": 7})
    user = req.messages[1]["content"]
    assert [p["type"] for p in user] == ["image", "video", "text"]
    assert isinstance(user[0]["image"], MediaRef)  # parsing does no I/O and no decoding
    resolved(req)
    assert user[0]["image"].size == (24, 16) and [f.size for f in user[1]["video"]] == [(24, 16)] * 2
    assert req.stream and req.include_usage
    sp = req.sampling
    assert sp.temperature == 1.0 and sp.max_tokens == 32 and sp.stop == ("END",) and sp.seed == 7


def test_audio_part_is_resampled_to_the_model_rate():
    import wave
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(np.zeros(8000, dtype="<i2").tobytes())
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    req = resolved(parse({"messages": [{"role": "user", "content": [part]}]}, ("audio",), 16000), 16000)
    assert req.messages[0]["content"][0]["audio"].shape == (16000,)


@pytest.mark.parametrize("body, needle", [
    ([], "JSON object"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "not served here"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "needs"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x", "fps": -1}}]}]},
     "fps must be a positive number"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA=="}}]}]},
     "takes image, video"),
    ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}}]}]},
     "takes image, video"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "unsupported content part"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=1"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_requests_say_what_to_change(body, needle):
    with pytest.raises(oa.BadRequest, match=needle):
        parse(body)


def test_neutral_values_of_unsupported_options_are_accepted():
    req = parse({"messages": [{"role": "user", "content": "x"}], "tools": [], "logprobs": False,
                 "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
                 "tool_choice": "none", "temperature": 0})
    assert req.sampling.greedy


def test_bad_media_is_refused_when_the_request_is_resolved():
    from easerve.media import MediaError

    req = parse({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]})
    with pytest.raises(MediaError, match="not valid base64"):
        resolved(req)
