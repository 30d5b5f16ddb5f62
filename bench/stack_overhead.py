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
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2.5-vl")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bench-scale tiny build)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (both sides)")
    return ap.parse_args(argv)


def png(seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


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

    from easerve.models.tiny import cached_tiny
    from hasctl.deployment import preset
    from hasctl.launch import Stack

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(cached_tiny(args.family, args.cache_dir, scale="bench"))
    concs = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, float] = {}
    for c in concs:
        n, dt = in_process(model, c, args.max_tokens)
        results[f"inprocess_c{c}_tok_s"] = round(n / dt, 2)
        print(f"in-process c={c}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    d = preset("default").with_model(model).with_gateway_ports(0, 0)
    for stage in ("encode", "prefill", "decode"):
        d = d.with_flags(stage, threads=args.threads)
    with Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"}) as stack:
        for c in concs:
            n, dt = asyncio.run(_stack_run(stack.endpoints.grpc, c, args.max_tokens))
            results[f"stack_c{c}_tok_s"] = round(n / dt, 2)
            print(f"stack c={c}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    ratios = {f"stack_over_inprocess_c{c}": round(results[f"stack_c{c}_tok_s"] / results[f"inprocess_c{c}_tok_s"], 3)
              for c in concs}
    head = "stack_over_inprocess_c16"
    out = {head: ratios.pop(head)} if head in ratios else {}
    print(json.dumps({**out, **ratios, **results, "max_tokens": args.max_tokens, "model": Path(model).name}))


if __name__ == "__main__":
    main()
