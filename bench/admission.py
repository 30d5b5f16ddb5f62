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

After the trace, both stacks serve the light loads `LIGHT` (0.5 and 0.7 of the SLO capacity S,
--requests each, new images, the same on both): `refused_share_light` is the share of them the on
stack refused (target < 0.01: whatever its calibration learned in the overload must not turn away a
load the stack can carry), `refused_light_would_have_met` the share of those refusals that met the
tier on the off stack (a refusal of a request that would have missed is admission doing its job).
S, measured on the off stack before the trace, is the highest rate on the grid `SLO_GRID` (fractions
of C, from the top) at which --requests Poisson arrivals meet the tier at least --attainment of the
time: the load the stack can carry within the tier. C itself is not that: at 0.7 C the off stack
misses the tier for a third of the requests or more (the stored run's `light_of_burst`: 39 of 60
met), and refusing those is what admission is for. The same light fractions of C are run too and
reported apart (`light_of_burst`), with how many of their refusals would have met.

Last stdout line: JSON, "goodput_on_over_off" first (target >= 1.5), "ttft_pred_rel_err_median"
(<= 0.25), "refused_would_have_missed" (>= 0.9), "refused_share_light" (< 0.01), then the
per-mode figures.

  python bench/admission.py                 # bench-scale checkpoint, 60 requests at 2x capacity
  python bench/admission.py --quick         # tiny checkpoint, quick profile, a smoke run (< 2 min)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, scoring, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint, served_name  # noqa: E402
from bench.harness.load import png_uri, replay_images  # noqa: E402

LIGHT = (0.5, 0.7)  # light loads (x capacity) run on both stacks after the overload trace
SLO_GRID = (0.8, 0.65, 0.5, 0.4, 0.3, 0.2)  # fractions of the burst capacity tried for the SLO capacity


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
    ap.add_argument("--light-requests", type=int, default=None,
                    help="requests of each light load (default: --requests); more of them narrow refused_share_light")
    ap.add_argument("--burst", type=int, default=24, help="concurrent requests that measure the capacity")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="share of requests meeting the tier that defines the SLO capacity (the light loads' base)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.burst, args.image_size, args.max_tokens = 16, 6, 56, 6
    return args


def workload(n: int, rate: float, seed: int) -> list[tuple[float, int]]:
    """(arrival s, image seed): Poisson arrivals, a new image each (per seed: no run reuses another's
    images, so no encoder- or prefix-cache hit flatters one stack)."""
    rng = np.random.default_rng(seed)
    return [(float(t), 20_000 + 1000 * seed + k) for k, t in enumerate(np.cumsum(rng.exponential(1.0 / rate, n)))]


def run_load(url: str, model: str, reqs, size: int, max_tokens: int) -> tuple[list, float]:
    """Replay (arrival s, image seed) pairs; a refused request (429) is a reply with error_kind http_429."""
    return replay_images(url, model, [(t, png_uri(img, size)) for t, img in reqs], max_tokens)


def slo_capacity(run, capacity: float, limits, n: int, attainment: float, seed: int) -> tuple[float, dict]:
    """The highest rate of SLO_GRID x capacity at which n Poisson arrivals (new images) meet the
    limits at least `attainment` of the time on the stack `run` drives (the lowest rate of the grid
    when none does), and the attainment measured at each rate tried."""
    tried = {}
    for k, frac in enumerate(SLO_GRID):
        recs, _ = run(workload(n, frac * capacity, seed + 30 + k))
        tried[f"{frac}x"] = share = sum(scoring.met(r, limits) for r in recs) / len(recs)
        if share >= attainment:
            return frac * capacity, tried
    return SLO_GRID[-1] * capacity, tried


def light_loads(urls: dict, run, base: float, n: int, limits, seed: int) -> dict:
    """LIGHT x base on both stacks, the on stack first (what it learned in the overload before
    anything else): per load, the refusals of the on stack and how many of them met the tier off."""
    out = {}
    for k, frac in enumerate(LIGHT):
        trace = workload(n, frac * base, seed + k)
        got = {m: run(urls[m], trace)[0] for m in ("on", "off")}
        refused = [i for i, r in enumerate(got["on"]) if r.error_kind == "http_429"]
        out[f"{frac}x"] = {"rate_rps": round(frac * base, 3), "requests": len(trace), "refused": len(refused),
                           "refused_would_have_met": sum(scoring.met(got["off"][i], limits) for i in refused),
                           "met_on": sum(scoring.met(r, limits) for r in got["on"]),
                           "met_off": sum(scoring.met(r, limits) for r in got["off"])}
    return out


def shares(light: dict) -> tuple[float, float]:
    """(refused / requests, refusals that would have met / refusals) over the light loads."""
    refused = sum(c["refused"] for c in light.values())
    return (round(refused / max(1, sum(c["requests"] for c in light.values())), 4),
            round(sum(c["refused_would_have_met"] for c in light.values()) / max(1, refused), 4))


def bench_model(args) -> str:
    """The tiny checkpoint with --quick, else the bench-scale one (or --model)."""
    return checkpoint(args.model, args.cache_dir, scale="tiny" if args.quick else "bench")


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


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    model = bench_model(args)
    name = served_name(model)
    profile = profile_of(args, model)
    print(f"checkpoint and profile ready after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    from easerve import profile_format as pf
    limits = pf.load(profile).slo(args.tier).limits("image")
    run = lambda url, reqs: run_load(url, name, reqs, args.image_size, args.max_tokens)  # noqa: E731
    d = lambda adm: stack.deployment(model, args.preset, grace_s=1.0, gateway={  # noqa: E731
        "profile": profile, "admission": adm, "slo_tier": args.tier})
    stacks = stack.start_all({"off": lambda: stack.start(d("off")), "on": lambda: stack.start(d("reject"))})
    try:
        urls = {m: st.endpoints.http for m, st in stacks.items()}
        print(f"both stacks serving after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for url in urls.values():  # the same warm-up on both stacks: every batch shape once, cold
            run(url, workload(args.burst // 2, 4.0, 90))
        burst, wall = run(urls["off"], [(0.0, 1000 + k) for k in range(args.burst)])
        capacity = sum(r.ok for r in burst) / wall
        run(urls["on"], [(0.0, 1000 + k) for k in range(args.burst)])  # alike (what it admits of it)
        rate = args.mult * capacity
        print(f"capacity {capacity:.2f} req/s -> trace at {rate:.2f} req/s; tier {args.tier}: "
              f"TTFT {limits[0]:.0f} ms, TPOT {limits[1]:.1f} ms", file=sys.stderr)
        slo_cap, tried = slo_capacity(lambda reqs: run(urls["off"], reqs), capacity, limits, args.requests,
                                      args.attainment, args.seed)
        print(f"SLO capacity {slo_cap:.2f} req/s (attainment by fraction of capacity: {tried})", file=sys.stderr)
        before = {m: len(stack.trace_records(u)) for m, u in urls.items()}
        if not args.quick:  # calibration at lower rates too, on both stacks alike
            for k, frac in enumerate((0.5, 1.0)):
                for url in urls.values():
                    run(url, workload(args.requests // 2, frac * capacity, args.seed + 1 + k))
        reqs = workload(args.requests, rate, args.seed)
        recs, walls = {}, {}
        for mode in ("off", "on"):
            recs[mode], walls[mode] = run(urls[mode], reqs)
        # right after the overload: what the on stack's calibration learned there must not refuse these
        n_light = args.light_requests or args.requests
        light = light_loads(urls, run, slo_cap, n_light, limits, args.seed + 10)
        light_burst = light_loads(urls, run, capacity, n_light, limits, args.seed + 20)
        every = {m: stack.trace_records(u) for m, u in urls.items()}
        traced = [r for m in urls for r in every[m][before[m]:]]
        dump = ROOT / "runs" / "admission" / "last-run.json"  # with the warm-up and burst records, for study
        dump.write_text(json.dumps({"records": traced, "every_record": every, "measured_from": before,
                                    "results": {m: [r.to_dict() for r in rs] for m, rs in recs.items()},
                                    "trace": reqs}))
    finally:
        stack.stop_all(stacks, grace_s=3.0)  # idle by now
    errs = [abs(r["predicted_ttft_ms"] - r["ttft_ms"]) / r["ttft_ms"] for r in traced if r["ttft_ms"]]
    refused = [i for i, r in enumerate(recs["on"]) if r.error_kind == "http_429"]
    missed = [i for i in refused if not scoring.met(recs["off"][i], limits)]
    off, on = (scoring.summary_with_refusals(recs[m], limits, walls[m]) for m in ("off", "on"))
    (light_share, light_met), (burst_share, burst_met) = shares(light), shares(light_burst)
    print("off:", json.dumps(off), "\non:", json.dumps(on), file=sys.stderr)
    print(f"done after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = {"goodput_on_over_off": scoring.ratio(on["goodput_rps"], off["goodput_rps"]),
           "ttft_pred_rel_err_median": float(np.median(errs)) if errs else None,
           "refused_would_have_missed": len(missed) / len(refused) if refused else None,
           "refused_share_light": light_share, "refused_light_would_have_met": light_met,
           "slo_capacity_rps": round(slo_cap, 3), "light": light, "attainment": args.attainment,
           "slo_capacity_tried": tried,
           "refused_share_light_of_burst": burst_share, "refused_light_of_burst_would_have_met": burst_met,
           "light_of_burst": light_burst,
           "capacity_rps": capacity, "rate_rps": rate, "requests": len(reqs), "tier": args.tier,
           "ttft_limit_ms": limits[0], "tpot_limit_ms": limits[1], "quick": args.quick,
           "predictions": len(errs), "off": off, "on": on}
    results.finish("admission", args, out, argv, lambda: results.report_plots(
        [scoring.report_row(f"admission {m}", rate, recs[m], limits, walls[m]) for m in ("off", "on")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
