"""OpenAI chat schema -> domain request: what is accepted, and what gets a 400 with a reason."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from easerve.errors import BadRequest
from easerve.media import MediaConfig, MediaResolver
from easerve.types import MediaRef
from easerve.models.prompts import hf_messages
from easerve.stages.gateway import openai_api as oa
from easerve.types import ChatMessage, MediaPart, TextPart

MODALITIES = ("image", "video")


def _png(h=16, w=24) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def parse(body, modalities=MODALITIES, rate=None):
    return oa.parse_chat_request(body, "m", modalities, rate, default_max_tokens=32)


def resolved(req, rate=None) -> tuple[ChatMessage, ...]:
    """The request's messages with their MediaRefs fetched and decoded, as GatewayCore.preprocess does."""
    return asyncio.run(MediaResolver(MediaConfig(audio_rate=rate)).resolve_messages(req.messages))


def test_parts_become_typed_messages_and_sampling_follows_openai_defaults():
    req = parse({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png()}},
                                     {"type": "video_url", "video_url": {"frames": [_png(), _png()]}},
                                     {"type": "text", "text": "what?"}]}],
        "stream": True, "stream_options": {"include_usage": True}, "stop": "END", "seed": 7})
    assert req.messages[0] == ChatMessage("system", (TextPart("be brief"),))
    user = req.messages[1].content
    assert [(type(p), getattr(p, "kind", None)) for p in user] == [(MediaPart, "image"), (MediaPart, "video"),
                                                                   (TextPart, None)]
    assert isinstance(user[0].ref, MediaRef) and not user[0].decoded  # parsing does no I/O and no decoding
    messages = resolved(req)
    decoded = messages[1].content
    assert decoded[0].value.size == (24, 16) and [f.size for f in decoded[1].value] == [(24, 16)] * 2
    assert decoded[2] is user[2] and not user[0].decoded  # new parts; the parsed request is left as it was
    assert hf_messages(messages) == [  # the chat template's form, built by the adapter only
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "image", "image": decoded[0].value},
                                     {"type": "video", "video": decoded[1].value}, {"type": "text", "text": "what?"}]}]
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
    messages = resolved(parse({"messages": [{"role": "user", "content": [part]}]}, ("audio",), 16000), 16000)
    assert messages[0].content[0].value.shape == (16000,)


M = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, needle", [
    ([], "JSON object"),
    ({"model": "other", "messages": M}, "model: 'other' is not served here"),
    ({"model": 5, "messages": M}, r"^model: Input should be a valid string"),
    ({}, r"^messages: required field missing"),
    ({"messages": []}, r"^messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"^messages\[0\]\.role: "),
    ({"messages": [{"role": "user", "content": 5}]}, r"^messages\[0\]\.content: must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, r"^messages\[0\]\.content\[0\]\.type: required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     r"^messages\[0\]\.content\[0\]: .*needs"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x", "fps": -1}}]}]},
     r"^messages\[0\]\.content\[0\]: .*fps must be a positive number"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA=="}}]}]},
     "takes image, video"),
    ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}}]}]},
     "takes image, video"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "unsupported content part"),
    ({"messages": M, "max_tokens": 0}, r"^max_tokens: .*greater than or equal to 1 \(got 0\)"),
    ({"messages": M, "max_tokens": True}, r"^max_tokens: Input should be a valid integer \(got True\)"),
    ({"messages": M, "max_completion_tokens": 1.5}, r"^max_completion_tokens: "),
    ({"messages": M, "max_tokens": 1 << 40}, r"^max_tokens: .*less than or equal"),
    ({"messages": M, "temperature": -1}, r"^temperature: .*greater than or equal to 0"),
    ({"messages": M, "temperature": "1"}, r"^temperature: Input should be a valid number \(got '1'\)"),
    ({"messages": M, "temperature": float("nan")}, r"^temperature: Input should be a finite number"),
    ({"messages": M, "top_p": 0}, r"^top_p: "),
    ({"messages": M, "top_k": -2}, r"^top_k: "),
    ({"messages": M, "seed": "x"}, r"^seed: Input should be a valid integer \(got 'x'\)"),
    ({"messages": M, "seed": 1 << 64}, r"^seed: "),
    ({"messages": M, "stop": [1, 2]}, r"^stop\[0\]: .*; stop\[1\]: "),
    ({"messages": M, "stop": [""]}, r"^stop\[0\]: String should have at least 1 character"),
    ({"messages": M, "stop_token_ids": [-1]}, r"^stop_token_ids\[0\]: "),
    ({"messages": M, "stream": "true"}, r"^stream: Input should be a valid boolean"),
    ({"messages": M, "stream_options": {"include_usage": "yes"}}, r"^stream_options\.include_usage: "),
    ({"messages": M, "timeout": 0}, r"^timeout: "),
    ({"messages": M, "tool_choice": 5}, r"^tool_choice: Input should be 'none', 'auto' or 'required' \(got 5\)"),
    ({"messages": M, "n": 17}, r"^n: Input should be less than or equal to 16 \(got 17\)"),
    ({"messages": M, "n": 0}, r"^n: Input should be greater than or equal to 1"),
    ({"messages": M, "n": "2"}, r"^n: Input should be a valid integer"),
    ({"messages": M, "tools": [{"type": "function"}]}, r"^tools\[0\]\.function: required field missing"),
    ({"messages": M, "tools": [{"type": "function", "function": {"name": "a b"}}]}, r"^tools\[0\]\.function\.name: "),
    ({"messages": M, "tool_choice": "required"}, r"^tool_choice: needs tools"),
    ({"messages": M, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, r"^tool_choice: function 'g' is not in tools \(f\)"),
    ({"messages": M, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, r"^tools: function names must be unique"),
    ({"messages": M, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, r"^response_format and tool_choice each constrain the output"),
    ({"messages": [{"role": "assistant"}]}, r"^messages\[0\]: content is required"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{x"}}]}]}, r"^messages\[0\]\.tool_calls: arguments of 'f' must be a JSON"),
    ({"messages": M, "top_logprobs": 2}, r"^top_logprobs: needs logprobs: true"),
    ({"messages": M, "top_logprobs": 99}, r"^top_logprobs: "),
    ({"messages": M, "presence_penalty": 2.5}, r"^presence_penalty: .*less than or equal to 2"),
    ({"messages": M, "repetition_penalty": 0}, r"^repetition_penalty: .*greater than 0"),
    ({"messages": M, "min_p": 1.5}, r"^min_p: .*less than or equal to 1"),
    ({"messages": M, "max_tokens": 3, "min_tokens": 4}, r"min_tokens must be in 0\.\.max_tokens \(3\), got 4"),
    ({"messages": M, "logit_bias": {"x": 1}}, r"^logit_bias\.x: String should match"),
    ({"messages": M, "logit_bias": {"5": 101}}, r"^logit_bias\.5: .*less than or equal to 100"),
    ({"messages": M, "response_format": {"type": "xml"}}, r"^response_format\.type: "),
    ({"messages": M, "response_format": {"type": "json_schema"}}, r"^response_format: .*needs json_schema"),
    ({"messages": M, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     r"^structured_outputs: .*exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"messages": M, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     r"^response_format and structured_outputs each constrain the output"),
    ({"messages": [{"role": "user", "content": "ok \ud800"}]}, r"^messages\[0\]\.content: invalid unicode"),
    ({"messages": M, "stop": ["\udfff"]}, r"^stop\[0\]: invalid unicode"),
])
def test_bad_requests_say_what_to_change(body, needle):
    with pytest.raises(BadRequest, match=needle):
        parse(body)


def test_max_completion_tokens_wins_over_max_tokens_and_developer_is_system():
    req = parse({"messages": [{"role": "developer", "content": "be brief"}, *M],
                 "max_tokens": 5, "max_completion_tokens": 9})
    assert req.sampling.max_tokens == 9
    assert parse({"messages": M, "max_tokens": 5}).sampling.max_tokens == 5
    assert req.messages[0].role == "system"


def test_unknown_fields_are_ignored_and_sampling_is_mapped():
    req = parse({"messages": M, "user": "u1", "metadata": {"k": "v"}, "parallel_tool_calls": True,
                 "top_k": -1, "seed": -1, "n": 1, "stop": "END", "stream_options": None})
    assert req.sampling.top_k == 0 and req.sampling.seed == (1 << 64) - 1 and req.sampling.stop == ("END",)
    assert req.sampling.n == 1 and parse({"messages": M, "n": 16, "seed": 3}).sampling.n == 16


def parse_completion(body, vocab=100):
    return oa.parse_completion_request(body, "m", vocab, default_max_tokens=16)


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])])
def test_completion_prompt_forms(prompt, expected):
    req = parse_completion({"prompt": prompt, "max_tokens": 3})
    assert req.prompt == expected and req.sampling.max_tokens == 3
    assert req.request_id.startswith("cmpl-")


@pytest.mark.parametrize("body, needle", [
    ({}, r"^prompt: required field missing"),
    ({"prompt": ""}, r"^prompt: must not be empty"),
    ({"prompt": ["a", "b"]}, r"^prompt: 2 prompts in one request are not supported"),
    ({"prompt": [1, "a"]}, r"^prompt: must be a non-empty string, or a non-empty list of token ids"),
    ({"prompt": [1, -1]}, r"^prompt: "),
    ({"prompt": []}, r"^prompt: "),
    ({"prompt": [100]}, r"^prompt: token id 100 is out of range; .* ids 0\.\.99"),
    ({"prompt": "x", "echo": True}, r"^echo: not supported"),
    ({"prompt": "x", "best_of": 2}, r"^best_of: not supported"),
    ({"prompt": "x", "suffix": "y"}, r"^suffix: not supported"),
    ({"prompt": "x", "logprobs": 21}, r"^logprobs: "),
    ({"prompt": "x", "n": 17}, r"^n: Input should be less than or equal to 16"),
    ({"prompt": "x\ud800"}, r"^prompt: invalid unicode"),
])
def test_bad_completion_requests_name_the_field(body, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_completion(body)


def test_logprobs_become_the_sampling_k():
    assert parse({"messages": M, "logprobs": True}).sampling.logprobs == 0
    assert parse({"messages": M, "logprobs": True, "top_logprobs": 3}).sampling.logprobs == 3
    assert parse({"messages": M, "logprobs": False}).sampling.logprobs is None
    assert parse_completion({"prompt": "x", "logprobs": 2}).sampling.logprobs == 2
    assert parse_completion({"prompt": "x"}).sampling.logprobs is None


def test_logprobs_json_shapes():
    from easerve.engine.logprobs import TokenLogprobs

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(ord("a") + i) for i in ids)
    lps = [(0, TokenLogprobs(-0.5, ((0, -0.5), (1, -1.5)))), (2, TokenLogprobs(-2.0, ()))]
    chat = oa.chat_logprobs(lps, Tok())["content"]
    assert chat[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                       "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                        {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    assert chat[1]["token"] == "c" and chat[1]["top_logprobs"] == []
    text = oa.text_logprobs(lps, Tok(), offset=4)
    assert text == {"tokens": ["a", "c"], "token_logprobs": [-0.5, -2.0],
                    "top_logprobs": [{"a": -0.5, "b": -1.5}, {}], "text_offset": [4, 5]}


def test_neutral_values_of_unsupported_options_are_accepted():
    req = parse({"messages": [{"role": "user", "content": "x"}], "tools": [], "logprobs": False,
                 "response_format": {"type": "text"},
                 "tool_choice": "none", "temperature": 0})
    assert req.sampling.greedy


def test_bad_media_is_refused_when_the_request_is_resolved():
    from easerve.errors import MediaError

    req = parse({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]})
    with pytest.raises(MediaError, match="not valid base64"):
        resolved(req)


def test_slo_tier_and_priority_come_from_the_body_and_a_bad_one_names_the_field():
    msgs = [{"role": "user", "content": "hi"}]
    req = parse({"messages": msgs, "slo_tier": "tight", "priority": "batch"})
    assert (req.slo_tier, req.priority) == ("tight", "batch")
    assert (parse({"messages": msgs}).slo_tier, parse({"messages": msgs}).priority) == (None, None)
    with pytest.raises(BadRequest, match="slo_tier"):
        parse({"messages": msgs, "slo_tier": "fast"})
    with pytest.raises(BadRequest, match="priority"):
        parse({"messages": msgs, "priority": "urgent"})


def test_usage_reports_prefix_cache_hits_and_migrations():
    from easerve.stages.gateway.choices import Delta
    from easerve.stages.gateway.openai_api import usage_json
    last = Delta([5], "x", "stop", prompt_tokens=7, completion_tokens=3, cached_tokens=4, migrations=2)
    assert usage_json(last) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                "prompt_tokens_details": {"cached_tokens": 4}, "easerve": {"migrations": 2}}
