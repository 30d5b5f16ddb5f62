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
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, scoring, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint, served_name  # noqa: E402
from bench.harness.load import alternate, png_uri, replay_images, segments, unloaded_limits  # noqa: E402

KEYS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "goodput_rps", "throughput_rps", "completed", "failed")


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
    results.add_save_flag(ap)
    return ap.parse_args(argv)


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


def main(argv=None) -> int:
    args = parse_args(argv)
    model = checkpoint(args.model, args.cache_dir)
    name = served_name(model)
    reqs = workload(args.requests, args.rate, args.repeat, args.seed)
    images = {img: png_uri(img, args.image_size) for img in {i for _, i in reqs}}
    repeats = len(reqs) - len(images)
    print(f"{len(reqs)} requests at {args.rate} req/s, {repeats} repeat an earlier image", file=sys.stderr)
    d = lambda gb: stack.deployment(model, args.preset, encode={"encoder_cache_gb": gb})  # noqa: E731
    stacks = stack.start_all({"off": lambda: stack.start(d(0.0)), "on": lambda: stack.start(d(args.cache_gb))})
    try:
        urls = {mode: st.endpoints.http for mode, st in stacks.items()}
        slo = unloaded_limits(urls, "off", name, args.image_size, args.max_tokens, args.slo_mult)
        recs, walls = alternate(urls, segments(reqs, args.segments), lambda url, part: replay_images(
            url, name, [(t, images[img]) for t, img in part], args.max_tokens))
        skipped = stack.counter(urls["on"], "easerve:gateway_preprocess_skipped_total")
    finally:
        stack.stop_all(stacks)
    off, on = (scoring.summary(recs[m], slo, KEYS, walls[m]) for m in ("off", "on"))
    print("off:", off, "\non:", on, file=sys.stderr)
    out = {"ttft_p99_off_over_on": scoring.ratio(off["p99_ttft_ms"], on["p99_ttft_ms"]),
           "goodput_on_over_off": scoring.ratio(on["goodput_rps"], off["goodput_rps"]),
           "rate_rps": args.rate, "requests": len(reqs), "repeated_fraction": repeats / len(reqs),
           "slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1],
           "on_preprocess_skipped": skipped, "off": off, "on": on}
    results.finish("encoder_cache", args, out, argv, lambda: results.report_plots(
        [scoring.report_row(f"cache {m}", args.rate, recs[m], slo, walls[m]) for m in ("off", "on")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
