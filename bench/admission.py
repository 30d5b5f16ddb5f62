"""SLO-aware admission at 2x capacity: the same seeded open-loop trace (Poisson arrivals of image
chat requests) against the same deployment with `--admission off` and `--admission reject`,
in one run, on the bench-scale Qwen2.5-VL checkpoint. Both gateways read the same profile
(`hasctl profile` of this checkpoint on this machine, made first unless `--profile` is given),
whose SLO tier (`--tier`, default moderate) is the target. Capacity C is the throughput of a
burst against the off stack; the trace runs at `--mult` x C (2). Goodput = requests meeting
both limits of the tier per second of load; a refused request (429) is not good.

The off gateway still predicts every request (its /trace has predicted and actual TTFT):
`ttft_pred_rel_err_median` is the median |predicted - actual| / actual over the off runs at
0.5 C, 1 C and the trace's rate; `refused_would_have_missed` is the share of the requests the
on stack refused that missed the tier in the off run of the same trace.

Last stdout line: JSON, "goodput_on_over_off" first (target >= 1.5), "ttft_pred_rel_err_median"
(<= 0.25), "refused_would_have_missed" (>= 0.9), then the per-mode figures.

  python bench/admission.py                 # bench-scale checkpoint, 60 requests at 2x capacity
  python bench/admission.py --quick         # tiny checkpoint, quick profile, a smoke run (< 2 min)
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import encoder_cache  # noqa: E402
from bench.encoder_cache import png_uri  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint, quick profile, few requests")
    ap.add_argument("--profile", default=None, help="profile of this checkpoint (default: made with hasctl profile)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--preset", default="default")
    ap.add_argument("--tier", default="moderate", choices=("tight", "moderate", "loose"))
    ap.add_argument("--mult", type=float, default=2.0, help="trace rate = this x the measured capacity")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--burst", type=int, default=24, help="concurrent requests that measure the capacity")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.burst, args.image_size, args.max_tokens = 16, 6, 56, 6
    return args


def workload(n: int, rate: float, seed: int) -> list[tuple[float, int]]:
    """(arrival s, image seed): Poisson arrivals, a new image each (per seed: no run reuses another's
    images, so no encoder- or prefix-cache hit flatters one stack)."""
    rng = np.random.default_rng(seed)
    return [(float(t), 20_000 + 1000 * seed + k) for k, t in enumerate(np.cumsum(rng.exponential(1.0 / rate, n)))]


# ---- client ------------------------------------------------------------------------------------
async def one(client, model: str, image: str, max_tokens: int) -> dict:
    """One streamed image request (bench/encoder_cache.py's): TTFT, TPOT, tokens; or refused
    (429) with its Retry-After, or failed."""
    import openai
    try:
        return await encoder_cache.one(client, model, image, max_tokens)
    except openai.RateLimitError as e:
        return {"refused": True, "retry_after": e.response.headers.get("retry-after")}
    except Exception as e:  # noqa: BLE001 - a failed request counts as failed
        return {"error": f"{type(e).__name__}: {e}"}


async def run_load(url: str, model: str, reqs, size: int, max_tokens: int) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    images = {img: png_uri(img, size) for _, img in reqs}
    t0 = time.perf_counter()

    async def at(t: float, img: int) -> dict:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        return await one(client, model, images[img], max_tokens)

    results = await asyncio.gather(*(at(t, img) for t, img in reqs))
    await client.close()
    return list(results), time.perf_counter() - t0


def met(r: dict, limits: tuple[float, float]) -> bool:
    return "ttft" in r and r["ttft"] * 1e3 <= limits[0] and r["tpot"] * 1e3 <= limits[1]


def summarize(results: list[dict], wall: float, limits: tuple[float, float]) -> dict:
    done = [r for r in results if "ttft" in r]
    return {"goodput_rps": sum(met(r, limits) for r in results) / wall, "throughput_rps": len(done) / wall,
            "completed": len(done), "refused": sum("refused" in r for r in results),
            "failed": sum("error" in r for r in results),
            "p50_ttft_ms": float(np.median([r["ttft"] for r in done]) * 1e3) if done else None,
            "slo_attainment": sum(met(r, limits) for r in results) / len(results), "wall_s": wall}


# ---- stacks and profile --------------------------------------------------------------------------
def bench_model(args) -> str:
    if args.quick and not args.model:
        from easerve.models.tiny import cached_tiny
        return str(cached_tiny("qwen2.5-vl", args.cache_dir))
    return encoder_cache.bench_model(args)


def profile_of(args, model: str) -> str:
    if args.profile:
        return args.profile
    out = ROOT / "runs" / "admission" / f"{Path(model).resolve().name}{'-quick' if args.quick else ''}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hasctl.cli", "profile", "--model", model, "--out", str(out), "--no-progress",
               *(["--quick"] if args.quick else [])]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return str(out)


def start_stack(args, model: str, profile: str, admission: str):
    from hasctl.deployment import preset
    from hasctl.launch import Stack
    d = (preset(args.preset).with_model(model).with_gateway_ports(0, 0)
         .with_flags("encode", threads=1, grace_s=1.0).with_flags("prefill", threads=1, grace_s=1.0)
         .with_flags("decode", threads=1, grace_s=1.0)
         .with_flags("gateway", profile=profile, admission=admission, slo_tier=args.tier, grace_s=1.0))
    return Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}).start(timeout=600)


def start_all(starts: dict) -> dict:
    """Start the stacks at once (name -> a call returning a started Stack); if one fails to start,
    stop the others and raise its error."""
    stacks, errors = {}, []
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futs = {name: pool.submit(start) for name, start in starts.items()}
        for name, fut in futs.items():
            try:
                stacks[name] = fut.result()
            except Exception as e:  # noqa: BLE001 - stop the others, then raise
                errors.append(e)
    if errors:
        for st in stacks.values():
            st.stop(grace_s=1.0)
        raise errors[0]
    return stacks


def trace_records(url: str) -> list[dict]:
    return json.loads(urllib.request.urlopen(url + "/trace?last=100000", timeout=10).read())["requests"]


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    model = bench_model(args)
    name = Path(model).resolve().name
    profile = profile_of(args, model)
    print(f"checkpoint and profile ready after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    from easerve import profile_format as pf
    limits = pf.load(profile).slo(args.tier).limits("image")
    run = lambda url, reqs: asyncio.run(run_load(url, name, reqs, args.image_size, args.max_tokens))  # noqa: E731
    stacks = start_all({m: lambda adm=adm: start_stack(args, model, profile, adm) for m, adm in (("off", "off"),
                                                                                              ("on", "reject"))})
    try:
        urls = {m: st.endpoints.http for m, st in stacks.items()}
        print(f"both stacks serving after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for url in urls.values():  # the same warm-up on both stacks: every batch shape once, cold
            run(url, workload(args.burst // 2, 4.0, 90))
        burst, wall = run(urls["off"], [(0.0, 1000 + k) for k in range(args.burst)])
        capacity = sum("ttft" in r for r in burst) / wall
        run(urls["on"], [(0.0, 1000 + k) for k in range(args.burst)])  # alike (what it admits of it)
        rate = args.mult * capacity
        print(f"capacity {capacity:.2f} req/s -> trace at {rate:.2f} req/s; tier {args.tier}: "
              f"TTFT {limits[0]:.0f} ms, TPOT {limits[1]:.1f} ms", file=sys.stderr)
        before = {m: len(trace_records(u)) for m, u in urls.items()}
        if not args.quick:  # calibration at lower rates too, on both stacks alike
            for k, frac in enumerate((0.5, 1.0)):
                for url in urls.values():
                    run(url, workload(args.requests // 2, frac * capacity, args.seed + 1 + k))
        reqs = workload(args.requests, rate, args.seed)
        results, walls = {}, {}
        for mode in ("off", "on"):
            results[mode], walls[mode] = run(urls[mode], reqs)
        every = {m: trace_records(u) for m, u in urls.items()}
        recs = [r for m in urls for r in every[m][before[m]:]]
        dump = ROOT / "runs" / "admission" / "last-run.json"  # with the warm-up and burst records, for study
        dump.write_text(json.dumps({"records": recs, "every_record": every, "measured_from": before,
                                    "results": results, "trace": reqs}))
    finally:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda st: st.stop(grace_s=3.0), stacks.values()))  # idle by now
    errs = [abs(r["predicted_ttft_ms"] - r["ttft_ms"]) / r["ttft_ms"] for r in recs if r["ttft_ms"]]
    refused = [i for i, r in enumerate(results["on"]) if "refused" in r]
    missed = [i for i in refused if not met(results["off"][i], limits)]
    off, on = (summarize(results[m], walls[m], limits) for m in ("off", "on"))
    print("off:", json.dumps(off), "\non:", json.dumps(on), file=sys.stderr)
    print(f"done after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = {"goodput_on_over_off": on["goodput_rps"] / off["goodput_rps"] if off["goodput_rps"] else None,
           "ttft_pred_rel_err_median": float(np.median(errs)) if errs else None,
           "refused_would_have_missed": len(missed) / len(refused) if refused else None,
           "capacity_rps": capacity, "rate_rps": rate, "requests": len(reqs), "tier": args.tier,
           "ttft_limit_ms": limits[0], "tpot_limit_ms": limits[1], "quick": args.quick,
           "predictions": len(errs), "off": off, "on": on}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
