"""Batched prefill vs one request at a time, on the same inputs, in one run.

N image requests (default 8) whose prompts differ in length (a different image size and a
different amount of text each) are encoded once; then, `--repeats` times, the prefill
adapter runs them (a) one at a time, `adapter.prefill([r])` for each r (the exact
unpadded path), and (b) as one call `adapter.prefill(all)`: one packed LM forward.
Both use the same torch thread count (`torch.set_num_threads(--threads)`, 1 by default).
The per-request greedy first tokens of (a) and (b) are compared (they must be equal).

Reported per mode: median wall time of the whole set (ms; the modes alternate within every
round, so load on a shared CPU hits both alike), prompt tokens per second. "linear_ceiling":
the same ratio for the LM's largest linear layer alone (request-sized matmuls vs one matmul
of all tokens), i.e. what batching can buy on this machine at all; prefill is mostly such
matmuls. Last stdout line: one JSON object, "batched_over_single" first (median single time
/ median batched time; target >= 2).

On a CPU a prompt of a few dozen tokens already keeps the matmuls near the core's peak, so
there the ratio follows "linear_ceiling"; short prompts show more of the per-request cost
(weight reads, Python per layer) that batching removes:

  python bench/prefill_batching.py                     # bench-scale qwen2.5-vl, built once into runs/
  python bench/prefill_batching.py --sides 56 --words 1,2,3,4,5,6,7,8    # short prompts
  python bench/prefill_batching.py --model DIR         # any checkpoint of an image family
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402

WORDS = ("describe the picture in detail and say what colours and shapes you can see in it "
         "then count the objects and tell me where each of them is placed").split()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder of an image family (default: bench-scale qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-qwen2.5-vl-bench"),
                    help="where the default bench-scale checkpoint is built once (cached_tiny)")
    ap.add_argument("--n", type=int, default=8, help="requests")
    ap.add_argument("--sides", default="56,84,112,140,168,196,224,252",
                    help="image side (px) per request, cycled")
    ap.add_argument("--words", default="2,5,8,11,14,17,20,23", help="words of text per request, cycled")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both modes")
    ap.add_argument("--seed", type=int, default=0)
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.n < 2 or args.repeats < 1 or args.threads < 1:
        ap.error("--n must be >= 2, --repeats >= 1, --threads >= 1")
    try:
        args.side_list = [int(x) for x in args.sides.split(",")]
        args.word_list = [int(x) for x in args.words.split(",")]
    except ValueError:
        ap.error("--sides and --words take comma-separated integers")
    if min(args.side_list) < 28 or min(args.word_list) < 1:
        ap.error("--sides must be >= 28 px and --words >= 1")
    return args


def requests(full, args):
    """args.n image requests, image sides and words of text cycled from --sides / --words."""
    from PIL import Image

    from easerve.types import PrefillRequest, items_meta

    rng = np.random.RandomState(args.seed)
    reqs = []
    for i in range(args.n):
        side, words = args.side_list[i % len(args.side_list)], args.word_list[i % len(args.word_list)]
        image = Image.fromarray(rng.randint(0, 256, (side, side, 3), dtype=np.uint8))
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
        prompt = full.preprocess([{"role": "user", "content": [{"type": "image", "image": image},
                                                               {"type": "text", "text": text}]}])
        reqs.append(PrefillRequest(f"r{i}", prompt.input_ids, full.encode(prompt.items),
                                   items_meta(prompt.items)))
    return reqs


def interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, list]]:
    """Median seconds per function over `repeats` rounds (after one warm-up round); every
    round runs each function once, in alternating order, so a load change on a shared CPU
    hits all of them alike. Also returns each function's last output."""
    outs = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for k in range(repeats):
        for name in (list(fns) if k % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            outs[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, outs


def gemm_ceiling(pre, lens: list[int], repeats: int) -> float:
    """What batching can buy the linear layers on this machine: time of one request-sized
    matmul per request over one matmul of all their tokens, on the LM's largest linear
    layer (first decoder layer). Prefill is mostly such matmuls, so this bounds the ratio."""
    layer = pre.language_model.layers[0]
    lin = max((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), key=lambda m: m.weight.numel())
    xs = [torch.randn(n, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device) for n in lens]
    packed = torch.cat(xs)
    with torch.inference_mode():
        t, _ = interleaved({"single": lambda: [lin(x) for x in xs], "packed": lambda: lin(packed)},
                           max(repeats, 5) * 4)
    return t["single"] / t["packed"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from easerve.models.loader import load_adapter

    path = Path(checkpoint(args.model, args.cache_dir))
    full = load_adapter(path, role="full")
    reqs = requests(full, args)
    del full
    pre = load_adapter(path, role="prefill")

    t, outs = interleaved({"single": lambda: [pre.prefill([r])[0] for r in reqs],
                           "batched": lambda: pre.prefill(reqs)}, args.repeats)
    (single_s, single), (batched_s, batched) = (t["single"], outs["single"]), (t["batched"], outs["batched"])
    lens = [len(r.input_ids) for r in reqs]
    ceiling = gemm_ceiling(pre, lens, args.repeats)
    tokens = sum(lens)
    same = [int(a.last_logits.argmax()) == int(b.last_logits.argmax()) for a, b in zip(single, batched)]
    rows = [("one at a time", single_s), (f"batched ({args.n} in one forward)", batched_s)]
    print(f"{args.n} requests, prompt lengths {lens} ({tokens} tokens), torch threads {args.threads}, "
          f"median of {args.repeats}")
    print(f"{'mode':<32}{'ms':>10}{'tok/s':>10}")
    for name, sec in rows:
        print(f"{name:<32}{sec * 1000:>10.1f}{tokens / sec:>10.0f}")
    print(f"linear-layer ceiling of batching on this machine: {ceiling:.2f}x")
    result = {
        "batched_over_single": round(single_s / batched_s, 3),
        "single_ms": round(single_s * 1000, 2),
        "batched_ms": round(batched_s * 1000, 2),
        "linear_ceiling": round(ceiling, 3),
        "padding_a_padded_batch_would_add": round(len(lens) * max(lens) / tokens, 3),
        "first_tokens_equal": all(same),
        "prompt_lens": lens,
        "threads": args.threads,
        "repeats": args.repeats,
    }
    finish("prefill_batching", args, result, argv)
    return result


if __name__ == "__main__":
    main()
