"""Batched prefill vs one request at a time, on the same inputs, in one run.

N image requests (default 8) whose prompts differ in length (a different image size and a
different amount of text each) are encoded once; then, `--repeats` times, the prefill
adapter runs them (a) one at a time, `adapter.prefill([r])` for each r (the exact
unpadded path), and (b) as one call `adapter.prefill(all)`: one right-padded LM forward.
Both use the same torch thread count (`torch.set_num_threads(--threads)`, 1 by default).
The per-request greedy first tokens of (a) and (b) are compared (they must be equal).

Reported per mode: median wall time of the whole set (ms), prompt tokens per second; and
the padding of the batch (padded tokens / real tokens). Last stdout line: one JSON object,
"batched_over_single" first (median single time / median batched time; target >= 2).

  python bench/prefill_batching.py                     # bench-scale qwen2.5-vl, built once into runs/
  python bench/prefill_batching.py --model DIR         # any checkpoint easerve can load
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("describe the picture in detail and say what colours and shapes you can see in it "
         "then count the objects and tell me where each of them is placed").split()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder of an image family (default: bench-scale qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-qwen2.5-vl-bench"),
                    help="where the default bench-scale checkpoint is built once (cached_tiny)")
    ap.add_argument("--n", type=int, default=8, help="requests")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both modes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.n < 2 or args.repeats < 1 or args.threads < 1:
        ap.error("--n must be >= 2, --repeats >= 1, --threads >= 1")
    return args


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    from easerve.models.tiny import cached_tiny
    return cached_tiny("qwen2.5-vl", args.cache_dir, seed=0, scale="bench")


def requests(full, n: int, seed: int):
    """n image requests: image side 56..252 px and 2..2+3n words of text, so lengths differ."""
    from PIL import Image

    from easerve.types import PrefillRequest

    rng = np.random.RandomState(seed)
    reqs = []
    for i in range(n):
        side = 56 + 28 * (i % 8)
        image = Image.fromarray(rng.randint(0, 256, (side, side, 3), dtype=np.uint8))
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + 3 * i))
        prompt = full.preprocess([{"role": "user", "content": [{"type": "image", "image": image},
                                                               {"type": "text", "text": text}]}])
        reqs.append(PrefillRequest(f"r{i}", prompt.input_ids, full.encode(prompt.items),
                                   [(it.modality, it.meta) for it in prompt.items]))
    return reqs


def timed(fn, repeats: int) -> tuple[float, list]:
    """Median seconds of `repeats` calls of fn (after one warm-up call) and the last output."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from easerve.models.registry import load_adapter

    path = checkpoint(args)
    full = load_adapter(path, role="full")
    reqs = requests(full, args.n, args.seed)
    del full
    pre = load_adapter(path, role="prefill")

    single_s, single = timed(lambda: [pre.prefill([r])[0] for r in reqs], args.repeats)
    batched_s, batched = timed(lambda: pre.prefill(reqs), args.repeats)

    lens = [len(r.input_ids) for r in reqs]
    tokens = sum(lens)
    same = [int(a.last_logits.argmax()) == int(b.last_logits.argmax()) for a, b in zip(single, batched)]
    rows = [("one at a time", single_s), (f"batched ({args.n} in one forward)", batched_s)]
    print(f"{args.n} requests, prompt lengths {lens} ({tokens} tokens), torch threads {args.threads}, "
          f"median of {args.repeats}")
    print(f"{'mode':<28}{'ms':>10}{'tok/s':>10}")
    for name, s in rows:
        print(f"{name:<28}{s * 1000:>10.1f}{tokens / s:>10.0f}")
    result = {
        "batched_over_single": round(single_s / batched_s, 3),
        "single_ms": round(single_s * 1000, 2),
        "batched_ms": round(batched_s * 1000, 2),
        "padding_ratio": round(len(lens) * max(lens) / tokens, 3),
        "first_tokens_equal": all(same),
        "prompt_lens": lens,
        "threads": args.threads,
        "repeats": args.repeats,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
