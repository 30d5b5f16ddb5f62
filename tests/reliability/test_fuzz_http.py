"""Fuzzing the OpenAI HTTP API of a live stack: seeded hypothesis strategies of malformed bodies
(bad JSON, wrong types, bad numbers, broken base64, truncated / corrupted / mistyped / empty /
oversize media, deep nesting, invalid unicode, over-long prompts) on /v1/chat/completions and
/v1/completions. Each one must get a 4xx with an OpenAI error body naming the problem; no
process may crash or restart; valid requests right after still succeed.

    EASERVE_TINY_CACHE=/tmp/tiny pytest -q -m slow tests/reliability/test_fuzz_http.py -s
prints the requests and statuses per family (the figures in docs/reliability/fuzzing.md).
"""
from __future__ import annotations

import http.client
import json
import random
import urllib.parse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.media import png_bytes
from tests.reliability.fuzz_cases import (fuzz, MIME, MP4, PNG, WAV, Tally, bad_number, broken_base64, corrupted,
                                          data_uri, dumps, truncated)

pytestmark = [pytest.mark.slow, pytest.mark.load]  # hundreds of requests: a long load test
TALLY = Tally()
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


class Http:
    """One keep-alive connection to the gateway (reopened when the server closes it)."""

    def __init__(self, base: str):
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname, u.port
        self.conn = None

    def post(self, path: str, body: bytes, ctype: str = "application/json") -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": ctype})
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, data
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@pytest.fixture(scope="module")
def vl(fuzz_vl):
    return _Target(fuzz_vl)


@pytest.fixture(scope="module")
def audio(fuzz_audio):
    return _Target(fuzz_audio)


class _Target:
    def __init__(self, stack):
        self.stack, self.http = stack, Http(stack.endpoints.http)
        self.pids = dict(stack.pids)

    def refused(self, family: str, path: str, body: bytes, ctype: str = "application/json") -> None:
        status, raw = self.http.post(path, body, ctype)
        TALLY.add(family, status)
        assert 400 <= status < 500, f"{family}: {status} for {body[:200]!r}: {raw[:300]!r}"
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"].strip(), raw
        assert err["code"] == status and err["type"]

    def ok(self, path: str, body: dict) -> dict:
        status, raw = self.http.post(path, dumps(body))
        assert status == 200, raw[:500]
        return json.loads(raw)


def chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def media_part(kind: str, value) -> dict:
    """An OpenAI content part of `kind` (image / video / audio) whose payload is `value`."""
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": value}}
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": value}}
    return {"type": "input_audio", "input_audio": {"data": value, "format": "wav"}}


def with_text(part: dict) -> list:
    return [{"type": "text", "text": "What is this?"}, part]


# ---- families of bodies -----------------------------------------------------------------------
VALID_CHAT = dumps(chat("hello"))
bad_json = st.one_of(
    st.integers(1, len(VALID_CHAT) - 1).map(lambda n: VALID_CHAT[:n]),            # truncated JSON
    st.binary(min_size=1, max_size=200).filter(lambda b: not b.strip().startswith((b"{", b"[", b'"'))),
    st.sampled_from([b"", b"   ", b"null", b"[]", b"1", b'"x"', b"true", b"{", b"{}", b"{'a': 1}",
                     b'{"messages": }', b'{"a":1,}', b"NaN", b"\xff\xfe{}", b'{"prompt": "\xff"}',
                     b"9" * 5000]),                                                 # past the digit limit
)

WRONG = {  # field -> values of the wrong type
    "messages": [1, "hi", {"role": "user"}, [1, 2], [{"role": 5, "content": "x"}], [{"role": "user"}],
                 [{"role": "robot", "content": "x"}], [{"role": "user", "content": 7}], [],
                 [{"role": "user", "content": [{"text": "no type"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 3}]}],
                 [{"role": "user", "content": [{"type": "hologram"}]}]],
    "max_tokens": ["10", [10], {"n": 1}, True, 2.5],
    "temperature": ["hot", [0.5], {}, False],
    "top_p": ["1", []],
    "stream": ["yes", 1, []],
    "stop": [5, [1, 2], [""], {"s": 1}, ["x"] * 65],
    "stop_token_ids": ["1", [-1], [1.5], ["a"]],
    "model": [123, ["m"], {}, "not-this-model"],
    "stream_options": ["usage", {"include_usage": "yes"}],
    "logprobs": ["yes", 3],
    "tools": [[{"type": "function"}], "f", [{"type": "function", "function": {"name": 5}}]],
    "response_format": ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 1}],
    "n": ["2"],
}
COMP_WRONG = {"prompt": [None, 5, [], [[]], ["a", "b"], [1.5], [-1], [True], {}, "", [[1], [2]]],
              "logprobs": [True, -1, 21], "echo": [True], "best_of": [3], "suffix": ["x"]}


def _replace(args):
    base, field, value = args
    return {**base, field: value}


wrong_types = st.one_of(
    st.sampled_from([(CHAT, f, v) for f, vs in WRONG.items() for v in vs]).map(
        lambda a: (a[0], _replace((chat("hi"), a[1], a[2])))),
    st.sampled_from([(COMP, f, v) for f, vs in COMP_WRONG.items() for v in vs]).map(
        lambda a: (a[0], _replace(({"prompt": "hi", "max_tokens": 2}, a[1], a[2])))),
)

NUMBER_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "timeout",
                 "top_logprobs", "presence_penalty", "n"]


def _numbers_body(args) -> tuple[str, dict]:
    path, (field, value), stream = args
    if path == COMP and field == "top_logprobs":
        field = "logprobs"  # the completions API's name for it
    base = chat("hi", logprobs=True) if path == CHAT else {"prompt": "hi"}
    return path, {**base, field: value, "stream": stream}


bad_numbers = st.tuples(st.sampled_from([CHAT, COMP]), st.sampled_from(NUMBER_FIELDS).flatmap(bad_number),
                        st.booleans()).map(_numbers_body)


def nested(depth: int, kind: str) -> str:
    """JSON text of `depth` nested lists or objects (built as text: json.dumps would recurse)."""
    return ("[" * depth + '"x"' + "]" * depth) if kind == "list" else ('{"a":' * depth + '"x"' + "}" * depth)


def _nested_body(args) -> tuple[str, bytes]:
    depth, kind, where = args
    inner = nested(depth, kind)
    if where == "body":
        return CHAT, inner.encode()
    if where == "prompt":
        return COMP, f'{{"prompt": {inner}, "max_tokens": 2}}'.encode()
    if where == "messages":
        return CHAT, f'{{"messages": {inner}}}'.encode()
    return CHAT, (f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "x", "extra": {inner}}},'
                  f' {inner}]}}], "max_tokens": 2}}').encode()


deep_nesting = st.tuples(st.sampled_from([20, 100, 1000, 5000, 100_000]), st.sampled_from(["list", "dict"]),
                         st.sampled_from(["content", "messages", "prompt", "body"])).map(_nested_body)

SURROGATES = ["\\ud800", "\\udfff", "a\\udc00b", "\\ud83d"]


def _unicode_body(args) -> tuple[str, bytes]:
    where, bad = args
    if where == "raw":  # invalid UTF-8 bytes inside a JSON string
        return CHAT, b'{"messages": [{"role": "user", "content": "caf' + bad.encode("latin-1") + b'"}]}'
    text = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    slot = {"content": '"hi"', "model": None, "stop": None, "prompt": None}[where]
    if where == "content":
        return CHAT, text.replace(slot, f'"x{bad}y"').encode()
    if where == "prompt":
        return COMP, f'{{"prompt": "p{bad}", "max_tokens": 2}}'.encode()
    return CHAT, text[:-1].encode() + f', "{where}": "{bad}"}}'.encode()


invalid_unicode = st.one_of(
    st.tuples(st.sampled_from(["content", "model", "stop", "prompt"]), st.sampled_from(SURROGATES)),
    st.tuples(st.just("raw"), st.sampled_from(["\xff", "\xc3", "\xe9\x80", "\xed\xa0\x80", "\xf8\x88\x80\x80"])),
).map(_unicode_body)

long_prompts = st.one_of(
    st.integers(600, 3000).map(lambda n: (COMP, {"prompt": " ".join(["word"] * n), "max_tokens": 2})),
    st.integers(513, 4000).map(lambda n: (COMP, {"prompt": [random.Random(n).randrange(100, 200)
                                                             for _ in range(n)], "max_tokens": 2})),
    st.integers(600, 2000).map(lambda n: (CHAT, chat("hello " * n))),
    st.integers(520, 2 ** 32 - 1).map(lambda n: (COMP, {"prompt": "hi there", "max_tokens": n})),
    st.integers(10 ** 6, 10 ** 9).map(lambda n: (COMP, {"prompt": [n], "max_tokens": 2})),  # past the vocab
)


# ---- tests ------------------------------------------------------------------------------------
@fuzz(120)
@given(bad_json, st.sampled_from([CHAT, COMP]))
def test_bad_json(vl, body, path):
    vl.refused("bad JSON", path, body)


@fuzz(150)
@given(wrong_types, st.booleans())
def test_wrong_types(vl, case, stream):
    vl.refused("wrong types", case[0], dumps({**case[1], "stream": stream} if "stream" not in case[1] else case[1]))


@fuzz(120)
@given(bad_numbers)
def test_bad_numbers(vl, case):
    vl.refused("huge / negative / NaN numbers", case[0], dumps(case[1]))


@fuzz(60)
@given(broken_base64, st.sampled_from(["image", "video"]))
def test_broken_base64(vl, value, kind):
    vl.refused("broken base64", CHAT, dumps(chat(with_text(media_part(kind, value)))))


@fuzz(40)
@given(broken_base64)
def test_broken_base64_audio(audio, value):
    audio.refused("broken base64", CHAT, dumps(chat(with_text(media_part("audio", value)))))


@fuzz(60)
@given(st.one_of(truncated("png").map(lambda b: ("image", b, "png")), truncated("mp4").map(lambda b: ("video", b, "mp4")),
                 corrupted("png").map(lambda b: ("image", b, "png")), corrupted("mp4").map(lambda b: ("video", b, "mp4"))))
def test_truncated_media(vl, case):
    kind, raw, fmt = case
    vl.refused("truncated / corrupted media", CHAT, dumps(chat(with_text(media_part(kind, data_uri(raw, MIME[fmt]))))))


@fuzz(40)
@given(truncated("wav"))
def test_truncated_audio(audio, raw):
    audio.refused("truncated / corrupted media", CHAT, dumps(chat(with_text(media_part("audio", data_uri(raw, MIME["wav"]))))))


WRONG_MIME = [("image", WAV, "image/png"), ("image", MP4, "image/jpeg"), ("image", b"GIF89a-not", "image/gif"),
              ("image", b"%PDF-1.4 not an image", "application/pdf"), ("image", b"hello world", "text/plain"),
              ("video", WAV, "video/mp4"), ("video", b"plain text", "text/plain"), ("video", b"\x00" * 64, "video/webm")]


@fuzz(40)
@given(st.sampled_from(WRONG_MIME), st.booleans())
def test_wrong_mime(vl, case, as_uri):
    kind, raw, mime = case
    value = data_uri(raw, mime) if as_uri else data_uri(raw, mime).split(",", 1)[1]
    vl.refused("wrong MIME types", CHAT, dumps(chat(with_text(media_part(kind, value)))))


@fuzz(20)
@given(st.sampled_from([(PNG, "audio/wav"), (MP4, "audio/wav"), (b"not audio", "audio/wav"),
                        (b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")]))
def test_wrong_mime_audio(audio, case):
    audio.refused("wrong MIME types", CHAT, dumps(chat(with_text(media_part("audio", data_uri(*case))))))


EMPTY = [media_part("image", ""), media_part("image", "data:image/png;base64,"), media_part("video", ""),
         media_part("video", "data:video/mp4;base64,"), {"type": "video_url", "video_url": {"frames": []}},
         {"type": "video_url", "video_url": {"frames": [""]}}, {"type": "image_url", "image_url": {}},
         {"type": "image_url"}, {"type": "video_url", "video_url": {"url": data_uri(MP4, "video/mp4"), "fps": 0}},
         {"type": "video_url", "video_url": {"url": data_uri(MP4, "video/mp4"), "fps": -3}},
         {"type": "image_url", "image_url": {"url": "   "}}]
BIG_SIDE = png_bytes(1, 9000, 3)       # past max_side (8192)
OVERSIZE = [media_part("image", data_uri(b"\x89PNG" + bytes(1_200_000), "image/png")),  # a body over --max-body-mb
            media_part("image", data_uri(BIG_SIDE, "image/png")),
            {"type": "video_url", "video_url": {"frames": [data_uri(BIG_SIDE, "image/png")]}}]


@fuzz(40)
@given(st.sampled_from([("empty media", p) for p in EMPTY] + [("oversize media", p) for p in OVERSIZE]), st.booleans())
def test_empty_and_oversize_media(vl, case, stream):
    family, part = case
    vl.refused(family, CHAT, dumps(chat(with_text(part), stream=stream)))


@fuzz(10)
@given(st.sampled_from([media_part("audio", ""), media_part("audio", "data:audio/wav;base64,"),
                        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "exe"}},
                        media_part("image", data_uri(PNG, "image/png"))]))  # an image to an audio-only model
def test_empty_audio(audio, part):
    audio.refused("empty media", CHAT, dumps(chat(with_text(part))))


@fuzz(40)
@given(deep_nesting)
def test_deep_nesting(vl, case):
    vl.refused("deep nesting", case[0], case[1])


@fuzz(40)
@given(invalid_unicode)
def test_invalid_unicode(vl, case):
    vl.refused("invalid unicode", case[0], case[1])


@fuzz(60)
@given(long_prompts, st.booleans())
def test_long_prompts(vl, case, stream):
    vl.refused("over-long prompts", case[0], dumps({**case[1], "stream": stream}))


# ---- afterwards ---------------------------------------------------------------------------------
def test_zz_valid_requests_after_and_nothing_restarted(vl, audio):
    """Last in the module: every process is the one that started, and valid requests succeed."""
    out = vl.ok(CHAT, chat(with_text(media_part("image", data_uri(PNG, "image/png"))), max_tokens=3))
    assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["usage"]["completion_tokens"] >= 1
    assert vl.ok(COMP, {"prompt": "The sky is", "max_tokens": 3})["usage"]["completion_tokens"] >= 1
    assert vl.ok(CHAT, chat(with_text(media_part("video", data_uri(MP4, "video/mp4")))))["choices"]
    assert audio.ok(CHAT, chat(with_text(media_part("audio", data_uri(WAV, "audio/wav")))))["choices"]
    for t in (vl, audio):
        assert t.stack.pids == t.pids and set(t.stack.restarts.values()) == {0}
    print(f"\nHTTP fuzz, requests and statuses per family:\n{TALLY.table()}")
    assert TALLY.total >= 700
