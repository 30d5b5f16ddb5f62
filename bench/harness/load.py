"""The load a bench sends: synthetic images, streamed chat requests through the OpenAI client,
and open-loop replay of a trace of arrivals. Each request is measured into a Reply, an
easerve.slo.RequestRecord (times in seconds from the replay's start) with the answer's text and
its cached prompt tokens, so that easerve.slo.compute_metrics scores it and `hasctl report`
plots it."""
from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from easerve.slo import RequestRecord

TIMEOUT_S = 600.0


@dataclass
class Reply(RequestRecord):
    text: str = ""
    cached_tokens: int = 0


def png_uri(seed: int, size: int | tuple[int, int]) -> str:
    """A data: URI of a seeded random RGB PNG, size = side or (width, height)."""
    from PIL import Image
    w, h = (size, size) if isinstance(size, int) else size
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(image: str, text: str = "Describe the image.") -> list[dict]:
    """One user turn: an image and a question."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": text}]}]


def client(url: str, timeout: float = TIMEOUT_S):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


async def chat(cl, model: str, messages: list[dict], max_tokens: int, rec: Reply, t0: float) -> Reply:
    """One streamed greedy request (ignore_eos) measured into `rec` (clock: perf_counter - t0).
    A refusal (429) is error_kind "http_429"; any other failure is counted, not raised."""
    import openai
    rec.sent_s = time.perf_counter() - t0
    text = []
    try:
        stream = await cl.chat.completions.create(
            model=model, max_tokens=max_tokens, stream=True, temperature=0.0, messages=messages,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content is not None:
                rec.chunk_s.append(time.perf_counter() - t0)
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                rec.output_tokens, rec.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                rec.cached_tokens = (details.cached_tokens or 0) if details else 0
    except openai.RateLimitError as e:
        rec.error, rec.error_kind = f"refused (retry-after {e.response.headers.get('retry-after')})", "http_429"
    except Exception as e:  # noqa: BLE001 - a failed request counts as failed
        rec.error, rec.error_kind = f"{type(e).__name__}: {e}", type(e).__name__
    rec.end_s = time.perf_counter() - t0
    rec.text = "".join(text)
    return rec


async def replay(url: str, model: str, arrivals: Sequence[float], messages: Sequence[list[dict]],
                 max_tokens: int) -> tuple[list[Reply], float]:
    """Open loop: request i (messages[i]) sent at arrivals[i] s after the start, concurrently;
    returns the replies and the wall time from the start to the last reply."""
    cl = client(url)
    t0 = time.perf_counter()

    async def at(i: int, t: float) -> Reply:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        return await chat(cl, model, messages[i], max_tokens, Reply(i, "image", t), t0)

    out = await asyncio.gather(*(at(i, t) for i, t in enumerate(arrivals)))
    await cl.close()
    return list(out), time.perf_counter() - t0


def replay_images(url: str, model: str, reqs: Sequence[tuple[float, str]], max_tokens: int,
                  text: str = "Describe the image.") -> tuple[list[Reply], float]:
    """replay() of (arrival s, image URI) pairs, one image question each, from sync code."""
    return asyncio.run(replay(url, model, [t for t, _ in reqs], [image_message(im, text) for _, im in reqs],
                              max_tokens))


def segments(reqs: list, n: int) -> list[list]:
    """A trace of (arrival s, ...) cut into n consecutive parts, each re-based to start at 0."""
    size = -(-len(reqs) // n)
    parts = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    return [[(t - part[0][0], *rest) for t, *rest in part] for part in parts]
