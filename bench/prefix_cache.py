"""Prefix caching under multi-turn image chats: the same seeded workload against the same
deployment with prefill's prefix cache off (`--no-prefix-cache`) and on, in one run.

Workload: conversations start at a fixed rate; each is one new image and 4 turns with a
growing history (turn k resends the image, the k-1 earlier questions and the answers the
server gave), turn k+1 sent as soon as turn k has finished. Both stacks stay up; the
conversations are cut into parts, each replayed against off, then on. The SLO is a multiple
of the cache-off stack's unloaded first-turn TTFT / TPOT; goodput = requests meeting both
limits per second of load.

Last stdout line: JSON, "ttft_p50_off_over_on" (turns 2-4; target >= 2), then
"goodput_on_over_off" (target >= 1.3), "hit_rate" (cached / prompt tokens, cache on), and
the per-mode figures.

  python bench/prefix_cache.py                  # 24 conversations (96 requests), 0.25 conv/s
  python bench/prefix_cache.py --quick          # a smoke run (tiny model, monolith), under 2 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.encoder_cache import png_uri, segments  # noqa: E402  (the same images, the same parts)

TURNS = 4
QUESTIONS = ["Describe the image.", "What colors stand out?", "What is in the corner?", "Sum it up in a line."]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--preset", default="default")
    ap.add_argument("--rate", type=float, default=1.2,
                    help="conversations started per second (1.2: past the cache-off capacity on 2 cores)")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slo-mult", type=float, default=4.0, help="SLO = this x the unloaded cache-off TTFT/TPOT")
    ap.add_argument("--segments", type=int, default=2, help="alternate off/on over this many parts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 conversations, short answers")
    args = ap.parse_args(argv)
    if args.quick:  # the monolith: fewest processes to start
        args.conversations, args.image_size, args.max_tokens, args.segments = 3, 56, 4, 1
        args.preset = "monolith"
    return args


# ---- workload ----------------------------------------------------------------------------------
def workload(n: int, rate: float, seed: int) -> list[tuple[float, int]]:
    """(start time s, image seed) per conversation: a fixed rate, a new image each."""
    rng = np.random.default_rng(seed)
    return [(k / rate, int(rng.integers(10_000, 1 << 30))) for k in range(n)]


def messages(image: str, history: list[str], turn: int) -> list[dict]:
    msgs: list[dict] = []
    for k in range(turn + 1):
        text = QUESTIONS[k]
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}] if k == 0 \
            else text
        msgs.append({"role": "user", "content": content})
        if k < turn:
            msgs.append({"role": "assistant", "content": history[k]})
    return msgs


async def one_turn(client, model: str, msgs: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = cached = prompt = 0
    text = []
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, stream=True, temperature=0.0, messages=msgs,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            last = time.perf_counter()
            first = first or last
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            n, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
    return {"t0": t0, "ttft": (first - t0) if first else float("inf"), "end": time.perf_counter(),
            "tpot": (last - first) / (n - 1) if first and n > 1 else 0.0, "tokens": n, "text": "".join(text),
            "cached": cached, "prompt": prompt}


async def conversation(client, model: str, image: str, max_tokens: int, start: float) -> list[dict]:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    out, history = [], []
    for turn in range(TURNS):
        try:
            r = await one_turn(client, model, messages(image, history, turn), max_tokens)
        except Exception as e:  # noqa: BLE001 - a failed turn ends its conversation; counted below
            out.append({"turn": turn, "error": f"{type(e).__name__}: {e}"})
            break
        out.append({**r, "turn": turn})
        history.append(r["text"] or ".")
    return out


async def run_load(url: str, model: str, convs, images: dict[int, str], max_tokens: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(conversation(client, model, images[img], max_tokens, t0 + t) for t, img in convs))
    await client.close()
    return [r for conv in runs for r in conv], time.perf_counter() - t0


def summarize(results: list[dict], wall: float, slo: tuple[float, float]) -> dict:
    done = [r for r in results if "error" not in r]
    later = np.array([r["ttft"] for r in done if r["turn"] > 0] or [float("inf")])
    good = sum(1 for r in done if r["ttft"] <= slo[0] and r["tpot"] <= slo[1])
    prompt = sum(r["prompt"] for r in done)
    return {"p50_ttft_later_turns_ms": float(np.percentile(later, 50) * 1000),
            "p99_ttft_later_turns_ms": float(np.percentile(later, 99) * 1000),
            "goodput_rps": good / wall, "completed": len(done), "failed": len(results) - len(done),
            "hit_rate": sum(r["cached"] for r in done) / prompt if prompt else 0.0, "wall_s": wall}


# ---- stacks ------------------------------------------------------------------------------------
def bench_model(args) -> str:
    if args.model:
        return args.model
    from easerve.models.tiny import cached_tiny
    return str(cached_tiny("qwen2.5-vl", args.cache_dir, **({} if args.quick else {"scale": "bench"})))


def start_stack(preset_name: str, model: str, cache_on: bool):
    from hasctl.deployment import preset
    from hasctl.launch import Stack
    off = {} if cache_on else {"no_prefix_cache": True}
    d = preset(preset_name).with_model(model).with_gateway_ports(0, 0)
    for stage, flags in (("encode", off), ("prefill", off), ("monolith", off), ("decode", {})):
        if getattr(d, stage):
            d = d.with_flags(stage, threads=1, **flags)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    stack.start(timeout=600)
    return stack


async def unloaded(url: str, model: str, size: int, max_tokens: int) -> tuple[float, float]:
    """Median TTFT and TPOT of sequential first turns, each with a new image."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    outs = [await one_turn(client, model, messages(png_uri(900 + k, size), [], 0), max_tokens) for k in range(3)]
    await client.close()
    return float(np.median([o["ttft"] for o in outs])), float(np.median([o["tpot"] for o in outs]))


def main(argv=None) -> int:
    args = parse_args(argv)
    model = bench_model(args)
    name = Path(model).resolve().name
    convs = workload(args.conversations, args.rate, args.seed)
    images = {img: png_uri(img, args.image_size) for _, img in convs}
    print(f"{len(convs)} conversations x {TURNS} turns, one started every {1 / args.rate:.1f} s", file=sys.stderr)
    stacks: dict = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once
            futs = {mode: pool.submit(start_stack, args.preset, model, mode == "on") for mode in ("off", "on")}
        failed = [f.exception() for f in futs.values() if f.exception() is not None]
        stacks.update({mode: f.result() for mode, f in futs.items() if f.exception() is None})
        if failed:
            raise failed[0]
        urls = {mode: st.endpoints.http for mode, st in stacks.items()}
        for url in urls.values():
            asyncio.run(unloaded(url, name, args.image_size, 2))  # warm-up, new images only
        ttft, tpot = asyncio.run(unloaded(urls["off"], name, args.image_size, args.max_tokens))
        slo = (args.slo_mult * ttft, args.slo_mult * max(tpot, 1e-3))
        print(f"unloaded (cache off): TTFT {ttft * 1000:.0f} ms, TPOT {tpot * 1000:.1f} ms -> SLO "
              f"{slo[0] * 1000:.0f} / {slo[1] * 1000:.1f} ms", file=sys.stderr)
        results, walls = {"off": [], "on": []}, {"off": 0.0, "on": 0.0}
        for part in segments(convs, args.segments):
            for mode in ("off", "on"):
                res, wall = asyncio.run(run_load(urls[mode], name, part, images, args.max_tokens))
                results[mode] += res
                walls[mode] += wall
    finally:
        for st in stacks.values():
            st.stop()
    off, on = (summarize(results[m], walls[m], slo) for m in ("off", "on"))
    print("off:", json.dumps(off), "\non:", json.dumps(on), file=sys.stderr)
    out = {"ttft_p50_off_over_on": off["p50_ttft_later_turns_ms"] / on["p50_ttft_later_turns_ms"],
           "goodput_on_over_off": on["goodput_rps"] / off["goodput_rps"] if off["goodput_rps"] else None,
           "hit_rate": on["hit_rate"], "conversations": len(convs), "turns": TURNS, "rate_cps": args.rate,
           "slo_ttft_ms": slo[0] * 1000, "slo_tpot_ms": slo[1] * 1000, "off": off, "on": on}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
