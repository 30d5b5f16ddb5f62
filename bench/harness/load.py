"""The load a bench sends: synthetic images, streamed chat requests through the OpenAI client,
and open-loop replay of a trace of arrivals. Each request is measured into a Reply, an
easerve.slo.RequestRecord (times in seconds from the replay's start) with the answer's text and
its cached prompt tokens, so that easerve.slo.compute_metrics scores it and `hasctl report`
plots it."""
from __future__ import annotations

import asyncio
import base64
import io
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from easerve.slo import RequestRecord

TIMEOUT_S = 600.0


@dataclass
class Reply(RequestRecord):
    """A RequestRecord with what the benches also read: the answer's text (a conversation resends
    it) and the prompt tokens the server served from its prefix cache."""

    text: str = ""
    cached_tokens: int = 0


def png_bytes(seed: int, size: int | tuple[int, int] = 56) -> bytes:
    """A seeded random RGB PNG, size = side or (width, height)."""
    from PIL import Image
    w, h = (size, size) if isinstance(size, int) else size
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def png_uri(seed: int, size: int | tuple[int, int]) -> str:
    """png_bytes as a data: URI."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed, size)).decode()


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


def unloaded(url: str, model: str, size: int | tuple[int, int], max_tokens: int, n: int = 3,
             text: str = "Describe the image.") -> list[Reply]:
    """n image requests sent one at a time (nothing else in flight), each with a new image."""
    return [replay_images(url, model, [(0.0, png_uri(900 + k, size))], max_tokens, text)[0][0] for k in range(n)]


def unloaded_limits(urls: dict[str, str], base: str, model: str, size, max_tokens: int, mult: float,
                    warm_tokens: int = 4) -> tuple[float, float]:
    """Warm every stack up with a few new images, then the SLO (TTFT ms, TPOT ms) = mult x the
    unloaded latency of the stack `base` (see scoring.unloaded_limits)."""
    from bench.harness.scoring import unloaded_limits as limits
    for url in urls.values():
        unloaded(url, model, size, warm_tokens)
    slo = limits(unloaded(urls[base], model, size, max_tokens), mult)
    print(f"SLO ({mult:g} x unloaded {base}): TTFT {slo[0]:.0f} ms, TPOT {slo[1]:.1f} ms", file=sys.stderr)
    return slo


def alternate(urls: dict[str, str], parts: list, run) -> tuple[dict[str, list], dict[str, float]]:
    """Each part of a workload replayed against every stack in turn (run(url, part) -> (records,
    wall s)), so that drift in the host's load falls on all alike: records and wall time per stack."""
    recs, walls = {k: [] for k in urls}, {k: 0.0 for k in urls}
    for part in parts:
        for k, url in urls.items():
            res, wall = run(url, part)
            recs[k] += res
            walls[k] += wall
    return recs, walls


def segments(reqs: list, n: int) -> list[list]:
    """A trace of (arrival s, ...) cut into n consecutive parts, each re-based to start at 0."""
    size = -(-len(reqs) // n)
    parts = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    return [[(t - part[0][0], *rest) for t, *rest in part] for part in parts]


def hasctl_bench(url: str, work, rate: float, n: int, seed: int, label: str = "", slo=None, warm: int = 4):
    """`hasctl bench` (hasctl.bench.run_bench) against url: `warm` short requests first (not
    measured), then n requests of the WorkloadSpec `work` at `rate` req/s (seeded Poisson,
    ignore_eos). Returns its BenchResult (BenchResult.to_dict() is what `hasctl report` reads)."""
    import dataclasses

    from hasctl.bench import BenchConfig, run_bench
    if warm:
        asyncio.run(run_bench(BenchConfig(url=url, rate=4.0, num_requests=warm, seed=seed + 999, progress=False,
                                          workload=dataclasses.replace(work, output_tokens=4))))
    return asyncio.run(run_bench(BenchConfig(url=url, rate=rate, num_requests=n, seed=seed, ignore_eos=True,
                                             slo=slo, label=label, progress=False, workload=work)))
