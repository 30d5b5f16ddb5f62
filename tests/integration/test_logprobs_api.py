"""Logprobs through the live stack: the SDK, the chat API (streamed and not) and the
completions API return, per output token, the model's log-probability of it and its top
alternatives, consistent across the three and with greedy sampling."""
from __future__ import annotations

import math

import pytest

from easerve import Client
from tests.support.media import data_uri, png_bytes

pytestmark = pytest.mark.slow
N = 5


def _check(lps, token_ids, k):
    assert len(lps) == len(token_ids)
    for lp, tid in zip(lps, token_ids):
        assert lp.logprob <= 0 and len(lp.top) == k
        assert lp.top[0][0] == tid and math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)  # greedy: the best
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_sdk_logprobs_cover_every_token_including_prefills(vl_stack):
    c = Client(vl_stack.endpoints.grpc, timeout=120)
    img = png_bytes(40, 40, seed=21)
    out = c.generate("What is this?", images=[img], max_tokens=N, ignore_eos=True, logprobs=3)
    _check(out.logprobs, out.token_ids, 3)
    streamed = [lp for ch in c.generate("What is this?", images=[img], max_tokens=N, ignore_eos=True,
                                        logprobs=3, stream=True) for lp in ch.logprobs]
    assert [lp.top for lp in streamed] == [lp.top for lp in out.logprobs]
    assert c.generate("Hi", max_tokens=2).logprobs == ()  # not asked: none


def test_openai_chat_and_completions_logprobs(vl_stack):
    from openai import OpenAI

    oa = OpenAI(base_url=vl_stack.endpoints.openai_base_url, api_key="none", max_retries=0)
    served = oa.models.list().data[0].id
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(32, 48, 2))}},
                                         {"type": "text", "text": "Describe."}]}]
    r = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0, logprobs=True,
                                   top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == N
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) and len(e.top_logprobs) == 2 for e in content)
    stream = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0, logprobs=True,
                                        top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    comp = oa.completions.create(model=served, prompt="Once upon a time", max_tokens=N, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    assert lp.text_offset == sorted(lp.text_offset)
    # keyed by token text, as OpenAI's format is: two byte-level pieces that decode alike share a key
    assert all(1 <= len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-5)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
