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
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, scoring, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint, served_name  # noqa: E402
from bench.harness.load import Reply, alternate, chat, client, png_uri, segments, unloaded_limits  # noqa: E402

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
    results.add_save_flag(ap)
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


async def conversation(cl, model: str, image: str, max_tokens: int, start: float, t0: float) -> list[tuple[int, Reply]]:
    """(turn, reply) of each turn; turn k+1 is sent when turn k has finished, a failed turn ends it."""
    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    out, history = [], []
    for turn in range(TURNS):
        r = await chat(cl, model, messages(image, history, turn), max_tokens,
                       Reply(0, "image", time.perf_counter() - t0), t0)
        out.append((turn, r))
        if not r.ok:
            break
        history.append(r.text or ".")
    return out


def run_load(url: str, model: str, convs, images: dict[int, str], max_tokens: int) -> tuple[list, float]:
    async def go():
        cl, t0 = client(url), time.perf_counter()
        runs = await asyncio.gather(*(conversation(cl, model, images[img], max_tokens, t, t0) for t, img in convs))
        await cl.close()
        return [r for conv in runs for r in conv], time.perf_counter() - t0
    return asyncio.run(go())


def summarize(turns: list[tuple[int, Reply]], wall: float, slo: tuple[float, float]) -> dict:
    recs = [r for _, r in turns]
    m = scoring.summary([r for t, r in turns if t > 0], slo, ("p50_ttft_ms", "p99_ttft_ms"))
    done = [r for r in recs if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return {"p50_ttft_later_turns_ms": m["p50_ttft_ms"], "p99_ttft_later_turns_ms": m["p99_ttft_ms"],
            **scoring.summary(recs, slo, ("goodput_rps", "completed", "failed"), wall),
            "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = checkpoint(args.model, args.cache_dir, scale="tiny" if args.quick else "bench")
    name = served_name(model)
    convs = workload(args.conversations, args.rate, args.seed)
    images = {img: png_uri(img, args.image_size) for _, img in convs}
    print(f"{len(convs)} conversations x {TURNS} turns, one started every {1 / args.rate:.1f} s", file=sys.stderr)
    off = {"no_prefix_cache": True}
    d = lambda on: stack.deployment(model, args.preset, **({} if on else {  # noqa: E731
        "encode": off, "prefill": off, "monolith": off}))
    stacks = stack.start_all({"off": lambda: stack.start(d(False)), "on": lambda: stack.start(d(True))})
    try:
        urls = {mode: st.endpoints.http for mode, st in stacks.items()}
        slo = unloaded_limits(urls, "off", name, args.image_size, args.max_tokens, args.slo_mult, warm_tokens=2)
        turns, walls = alternate(urls, segments(convs, args.segments),
                                 lambda url, part: run_load(url, name, part, images, args.max_tokens))
    finally:
        stack.stop_all(stacks)
    s_off, s_on = (summarize(turns[m], walls[m], slo) for m in ("off", "on"))
    print("off:", s_off, "\non:", s_on, file=sys.stderr)
    out = {"ttft_p50_off_over_on": scoring.ratio(s_off["p50_ttft_later_turns_ms"], s_on["p50_ttft_later_turns_ms"]),
           "goodput_on_over_off": scoring.ratio(s_on["goodput_rps"], s_off["goodput_rps"]),
           "hit_rate": s_on["hit_rate"], "conversations": len(convs), "turns": TURNS, "rate_cps": args.rate,
           "slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1], "off": s_off, "on": s_on}
    results.finish("prefix_cache", args, out, argv, lambda: results.report_plots(
        [scoring.report_row(f"prefix cache {m}", args.rate, [r for _, r in turns[m]], slo, walls[m])
         for m in ("off", "on")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
