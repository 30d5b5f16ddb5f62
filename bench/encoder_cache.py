"""The encoder-output cache under repeated media: the same open-loop workload (Poisson arrivals
of image chat requests, a fraction of them repeating an image sent earlier) against the same
deployment with the cache off (`--encoder-cache-gb 0`) and on, in one run, on the bench-scale
Qwen2.5-VL checkpoint. Both stacks stay up; the workload is cut into parts and each part is
replayed against off, then on (only one stack under load at a time), so drift in the host's
load falls on both alike. The SLO is a multiple of the cache-off stack's unloaded TTFT / TPOT,
measured first; goodput = requests meeting both limits per second of load.

Last stdout line: JSON, "ttft_p99_off_over_on" first (target >= 1.2), then
"goodput_on_over_off" (target >= 1.0), how many cache-on requests the gateway served without
decoding or the HF processor ("on_preprocess_skipped"), and the per-mode figures.

  python bench/encoder_cache.py                         # 80 requests at 0.5 req/s, 50 % repeats
  python bench/encoder_cache.py --rate 1 --requests 80 --repeat 0.5
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--preset", default="default")
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--repeat", type=float, default=0.5, help="fraction of requests repeating an earlier image")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slo-mult", type=float, default=4.0, help="SLO = this x the unloaded cache-off TTFT/TPOT")
    ap.add_argument("--cache-gb", type=float, default=1.0)
    ap.add_argument("--segments", type=int, default=4, help="alternate off/on over this many parts of the workload")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ---- workload ----------------------------------------------------------------------------------
def png_uri(seed: int, size: int) -> str:
    from PIL import Image
    arr = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def workload(n: int, rate: float, repeat: float, seed: int) -> list[tuple[float, int]]:
    """(arrival time s, image seed) per request: Poisson arrivals; with probability `repeat`
    (once an image exists) the image is one sent earlier, uniformly, else a new one."""
    rng = np.random.default_rng(seed)
    t, seen, out = 0.0, [], []
    for _ in range(n):
        t += rng.exponential(1.0 / rate)
        if seen and rng.random() < repeat:
            img = seen[rng.integers(len(seen))]
        else:
            img = 10_000 + len(seen)
            seen.append(img)
        out.append((t, img))
    return out


# ---- client ------------------------------------------------------------------------------------
async def one(client, model: str, image: str, max_tokens: int, text: str = "Describe the image.") -> dict:
    """One streamed image request (ignore_eos): when it was sent (t0), TTFT, end, TPOT, tokens."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, stream=True, temperature=0.0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": text}]}])
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return {"t0": t0, "ttft": (first - t0) if first else float("inf"), "end": time.perf_counter(),
            "tpot": (last - first) / (n - 1) if first and n > 1 else 0.0, "tokens": n}


async def run_load(url: str, model: str, reqs, images: dict[int, str], max_tokens: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()

    async def at(t: float, img: int) -> dict:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        try:
            return await one(client, model, images[img], max_tokens)
        except Exception as e:  # noqa: BLE001 - a failed request counts as failed, reported below
            return {"error": f"{type(e).__name__}: {e}"}

    results = await asyncio.gather(*(at(t, img) for t, img in reqs))
    await client.close()
    return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float, slo: tuple[float, float]) -> dict:
    done = [r for r in results if "error" not in r]
    ttfts = np.array([r["ttft"] for r in done]) if done else np.array([float("inf")])
    good = sum(1 for r in done if r["ttft"] <= slo[0] and r["tpot"] <= slo[1])
    return {"p50_ttft_ms": float(np.percentile(ttfts, 50) * 1000),
            "p99_ttft_ms": float(np.percentile(ttfts, 99) * 1000),
            "p50_tpot_ms": float(np.median([r["tpot"] for r in done]) * 1000) if done else None,
            "goodput_rps": good / wall, "throughput_rps": len(done) / wall, "completed": len(done),
            "failed": len(results) - len(done), "wall_s": wall}


# ---- stacks ------------------------------------------------------------------------------------
def bench_model(args) -> str:
    if args.model:
        return args.model
    from easerve.models.tiny import cached_tiny
    return str(cached_tiny("qwen2.5-vl", args.cache_dir, scale="bench"))


def start_stack(preset_name: str, model: str, cache_gb: float):
    from hasctl.deployment import preset
    from hasctl.launch import Stack
    d = preset(preset_name).with_model(model).with_gateway_ports(0, 0).with_flags(
        "encode", encoder_cache_gb=cache_gb, threads=1).with_flags("prefill", threads=1).with_flags("decode", threads=1)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    stack.start(timeout=600)
    return stack


async def unloaded(url: str, model: str, size: int, max_tokens: int) -> tuple[float, float]:
    """Median TTFT and TPOT of sequential requests, each with a new image."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    outs = [await one(client, model, png_uri(900 + k, size), max_tokens) for k in range(3)]
    await client.close()
    return float(np.median([o["ttft"] for o in outs])), float(np.median([o["tpot"] for o in outs]))


def gateway_counter(url: str, name: str) -> float:
    """A counter from the gateway's /metrics (0 before it first counts)."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def segments(reqs: list[tuple[float, int]], n: int) -> list[list[tuple[float, int]]]:
    """The workload cut into n consecutive parts, each part's arrivals re-based to start at 0."""
    size = -(-len(reqs) // n)
    parts = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    return [[(t - part[0][0], img) for t, img in part] for part in parts]


def main(argv=None) -> int:
    args = parse_args(argv)
    model = bench_model(args)
    name = Path(model).resolve().name
    reqs = workload(args.requests, args.rate, args.repeat, args.seed)
    images = {img: png_uri(img, args.image_size) for img in {i for _, i in reqs}}
    repeats = len(reqs) - len(images)
    print(f"{len(reqs)} requests at {args.rate} req/s, {repeats} repeat an earlier image", file=sys.stderr)
    stacks = {"off": start_stack(args.preset, model, 0.0)}
    try:
        stacks["on"] = start_stack(args.preset, model, args.cache_gb)
        urls = {mode: st.endpoints.http for mode, st in stacks.items()}
        for url in urls.values():
            asyncio.run(unloaded(url, name, args.image_size, 4))  # warm-up, new images only
        ttft, tpot = asyncio.run(unloaded(urls["off"], name, args.image_size, args.max_tokens))
        slo = (args.slo_mult * ttft, args.slo_mult * max(tpot, 1e-3))
        print(f"unloaded (cache off): TTFT {ttft * 1000:.0f} ms, TPOT {tpot * 1000:.1f} ms -> SLO "
              f"{slo[0] * 1000:.0f} / {slo[1] * 1000:.1f} ms", file=sys.stderr)
        results, walls = {"off": [], "on": []}, {"off": 0.0, "on": 0.0}
        for part in segments(reqs, args.segments):  # alternate, so load drift on the host hits both alike
            for mode in ("off", "on"):
                res, wall = asyncio.run(run_load(urls[mode], name, part, images, args.max_tokens))
                results[mode] += res
                walls[mode] += wall
        skipped = gateway_counter(urls["on"], "easerve:gateway_preprocess_skipped_total")
    finally:
        for st in stacks.values():
            st.stop()
    off, on = (summarize(results[m], walls[m], slo) for m in ("off", "on"))
    print("off:", json.dumps(off), "\non:", json.dumps(on), file=sys.stderr)
    out = {"ttft_p99_off_over_on": off["p99_ttft_ms"] / on["p99_ttft_ms"],
           "goodput_on_over_off": on["goodput_rps"] / off["goodput_rps"] if off["goodput_rps"] else None,
           "rate_rps": args.rate, "requests": len(reqs), "repeated_fraction": repeats / len(reqs),
           "slo_ttft_ms": slo[0] * 1000, "slo_tpot_ms": slo[1] * 1000,
           "on_preprocess_skipped": skipped, "off": off, "on": on}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
