"""Streaming tokens/s through the full stack (gateway -> encode -> prefill -> decode, four
processes, real gRPC) vs the in-process engine (easerve.pipeline: the same adapters and
decode engine, no sockets), at concurrency 1 and 16, measured in one run on the
bench-scale checkpoint. Both sides run the same requests (a small image + a text
prompt, greedy, `--max-tokens` each).

Last stdout line: one JSON object, "stack_over_inprocess_c16" first (target >= 0.9).

  python bench/stack_overhead.py [--family qwen2.5-vl] [--model DIR] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import sys
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import stack  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.load import png_bytes as png  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2.5-vl")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bench-scale tiny build)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (both sides)")
    add_save_flag(ap)
    return ap.parse_args(argv)


def in_process(model: str, conc: int, max_tokens: int) -> tuple[int, float]:
    from easerve.pipeline import InProcessPipeline
    from easerve.types import SamplingParams

    pipe = InProcessPipeline(model)
    msgs = lambda i: [{"role": "user", "content": [  # noqa: E731
        {"type": "image", "image": Image.open(io.BytesIO(png(i))).convert("RGB")},
        {"type": "text", "text": "Describe the image in detail."}]}]
    pipe.run([(msgs(99), SamplingParams(max_tokens=4))])  # warm-up
    t0 = time.perf_counter()
    outs = pipe.run([(msgs(i), SamplingParams(max_tokens=max_tokens)) for i in range(conc)])
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


async def _stack_run(target: str, conc: int, max_tokens: int) -> tuple[int, float]:
    from easerve import AsyncClient

    client = AsyncClient(target, timeout=600)
    await client.generate("warm up", images=[png(99)], max_tokens=4)

    async def one(i: int) -> int:
        n = 0
        async for chunk in await client.generate("Describe the image in detail.", images=[png(i)],
                                                 max_tokens=max_tokens, stream=True):
            n += len(chunk.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(conc)))
    return sum(counts), time.perf_counter() - t0


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = checkpoint(args.model, args.cache_dir, args.family)
    concs = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, float] = {}
    for c in concs:
        n, dt = in_process(model, c, args.max_tokens)
        results[f"inprocess_c{c}_tok_s"] = round(n / dt, 2)
        print(f"in-process c={c}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    st = stack.start(stack.deployment(model, threads=args.threads), env={"EASERVE_LOG_LEVEL": "WARNING"})
    try:
        for c in concs:
            n, dt = asyncio.run(_stack_run(st.endpoints.grpc, c, args.max_tokens))
            results[f"stack_c{c}_tok_s"] = round(n / dt, 2)
            print(f"stack c={c}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    finally:
        st.stop()
    ratios = {f"stack_over_inprocess_c{c}": round(results[f"stack_c{c}_tok_s"] / results[f"inprocess_c{c}_tok_s"], 3)
              for c in concs}
    head = "stack_over_inprocess_c16"
    out = {head: ratios.pop(head)} if head in ratios else {}
    finish("stack_overhead", args, {**out, **ratios, **results, "max_tokens": args.max_tokens, "model": Path(model).name},
           argv)


if __name__ == "__main__":
    main()
