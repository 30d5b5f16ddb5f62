"""Prefix caching on a 2 prefill x 2 decode stack: a 4-turn chat about one image, each turn
resending the image and the whole history through the openai package. Turns 2-4 report
`prompt_tokens_details.cached_tokens` > 0 (encode places each turn on the prefill instance
that holds its prefix), every turn's tokens equal a cold in-process run of the same
messages, and prefill's metrics count the hits in vLLM's names."""
from __future__ import annotations

import io
import re

import pytest
from PIL import Image

from easerve.pipeline import InProcessPipeline
from easerve.types import SamplingParams
from tests.support.media import data_uri, png_bytes
from tests.support.multi_stack import scrape_stage

pytestmark = pytest.mark.slow
N = 6
QUESTIONS = ["What is in this picture?", "What color is it?", "Is there anything else?", "Describe it again."]


def _messages(image_part, history: list[tuple[str, str]], question: str) -> list[dict]:
    """The first user turn carries the image; earlier answers are assistant turns."""
    msgs, first = [], True
    for q, a in [*history, (question, None)]:
        content = [image_part, {"type": "text", "text": q}] if first else q
        msgs.append({"role": "user", "content": content})
        first = False
        if a is not None:
            msgs.append({"role": "assistant", "content": a})
    return msgs


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_four_turn_image_chat_hits_and_equals_a_cold_run(multi):
    from openai import OpenAI

    model = multi.deployment.model
    oa = OpenAI(base_url=multi.endpoints.openai_base_url, api_key="none", max_retries=0)
    served = oa.models.list().data[0].id
    img = png_bytes(56, 84, seed=3)
    pipe = InProcessPipeline(model)
    pil = Image.open(io.BytesIO(img)).convert("RGB")
    history: list[tuple[str, str]] = []
    cached = []
    for q in QUESTIONS:
        msgs = _messages({"type": "image_url", "image_url": {"url": data_uri(img)}}, history, q)
        r = oa.chat.completions.create(model=served, messages=msgs, max_tokens=N, temperature=0)
        cold = pipe.run([(_messages({"type": "image", "image": pil}, history, q), SamplingParams(max_tokens=N))])[0]
        assert r.choices[0].message.content == pipe.lm.tokenizer.decode(cold.token_ids, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(cold.token_ids)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        history.append((q, r.choices[0].message.content))
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    scraped = [scrape_stage(multi, name) for name in multi._procs if name.startswith("prefill")]
    hits = sum(_counter(t, "easerve:prefix_cache_hits") for t in scraped)
    queries = sum(_counter(t, "easerve:prefix_cache_queries") for t in scraped)
    assert hits == sum(cached) and queries > hits


def test_sdk_usage_reports_cached_tokens(multi):
    from easerve import Client

    client = Client(multi.endpoints.grpc, timeout=120)
    img = png_bytes(64, 64, seed=5)
    prompt = "Describe this picture in a few words, please, and then say what colors it has."
    first = client.generate(prompt, images=[img], max_tokens=3)
    again = client.generate(prompt, images=[img], max_tokens=3)
    assert first.usage.cached_tokens == 0
    assert 0 < again.usage.cached_tokens < again.usage.prompt_tokens
    assert again.token_ids == first.token_ids
