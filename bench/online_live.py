"""The live part of bench/online_control.py (`--live`): one rate step on this machine, the
bench-scale checkpoint served by the `default` preset twice, its encode stage static and with
`--online`.

Both stacks start at once with the same knobs: encode B = --live-batch (1, the low phase's
choice: at the low rate a batch only waits for company). The online one runs encode `--online`
with B in --live-online-batch (1:16) and a short window / dwell (--live-window-s, dwell a
little less) so that it acts within a phase: B doubles while the encoder is busier than the
controller's high mark and halves when it idles. Everything else is the preset's.
- Capacity C: completed requests per second of a burst of --live-burst concurrent requests on
  the static stack (after a warm-up of both).
- SLO: the profile's --slo tier when --profile is given; otherwise measured like `hasctl profile`'s
  moderate tier: 4x the median TTFT and TPOT of --live-calib sequential requests on the idle
  static stack.
- Trace: seeded Poisson arrivals of image requests (a new image each), low -> high -> low at
  --live-rates x C (0.5, 1.25, 0.5), --live-phase-s each; the same arrivals and images go to the
  static stack, then to the online one (the other one idle meanwhile). The high phase is past
  what B = 1 carries but within what batching can win here: this machine's profile of the
  bench-scale checkpoint has 224x224 images at ~0.10-0.14 s each alone and ~0.08-0.10 s each in
  a batch of 8, so B buys the encoder at most ~1.25x; a higher step overloads both stacks.
Goodput: requests meeting both limits per second of the trace.

Ceiling (--live-ceiling-batches, default 4,16): more static stacks, each with B fixed at one of
those values, run the same trace. Per phase, the best of all the static arms (B = --live-batch
and these) is what a controller that only moves B could at best have chosen for that phase, had
it known the phase in advance and switched at no cost; their sum over the phases, over the
static arm's goodput, is "ceiling_over_static_live". Where it is under a target for
"online_over_static_live", no B schedule reaches the target on this machine.
Returns {"online_over_static_live", "ceiling_over_static_live", "live": {capacity, rates, slo,
static, online, per-phase goodput of every arm, changes}}.
"""
from __future__ import annotations

import time

import numpy as np

from bench.harness import scoring, stack
from bench.harness.checkpoint import checkpoint, served_name
from bench.harness.load import png_uri, replay_images

MODERATE = 4.0  # hasctl profile's moderate tier: this x the unloaded latency


def add_args(ap) -> None:
    g = ap.add_argument_group("live (--live)")
    g.add_argument("--live", action="store_true", help="run the live rate step too (~8 min here)")
    g.add_argument("--live-model", default=None, help="checkpoint (default: the bench-scale tiny qwen2.5-vl)")
    g.add_argument("--live-cache-dir", default=None, help="where the tiny checkpoints are (default: runs/tiny)")
    g.add_argument("--live-rates", default="0.5,1.25,0.5", help="low,high,low rates as multiples of the capacity")
    g.add_argument("--live-phase-s", type=float, default=40.0, help="length of each phase")
    g.add_argument("--live-batch", type=int, default=1, help="B both stacks start with (the static one keeps it)")
    g.add_argument("--live-online-batch", default="1:16", help="MIN:MAX of B for the online stack")
    g.add_argument("--live-window-s", type=float, default=6.0, help="the online controller's window")
    g.add_argument("--live-burst", type=int, default=32, help="concurrent requests that measure the capacity")
    g.add_argument("--live-calib", type=int, default=5, help="sequential requests that measure the SLO")
    g.add_argument("--live-image-size", type=int, default=224)
    g.add_argument("--live-max-tokens", type=int, default=8)
    g.add_argument("--live-ceiling-batches", default="4,16",
                   help="comma-separated B of extra static arms that measure the best any B schedule can do "
                        "('' for none)")


def quick(args) -> None:
    """--quick: the tiny checkpoint and short phases (a smoke run)."""
    args.live_phase_s, args.live_burst, args.live_calib = 8.0, 12, 3
    args.live_window_s, args.live_image_size, args.live_max_tokens = 3.0, 56, 4


def trace(rates: list[float], phase_s: float, seed: int) -> list[tuple[float, int]]:
    """(arrival s, image seed): Poisson arrivals per phase, a new image each."""
    rng, out, start = np.random.default_rng(seed), [], 0.0
    for r in rates:
        t = start + rng.exponential(1.0 / r)
        while t < start + phase_s:
            out.append((float(t), 30_000 + len(out)))
            t += rng.exponential(1.0 / r)
        start += phase_s
    return out


def start_stack(args, model: str, online: bool, batch: int | None = None):
    enc = dict(max_batch=batch or args.live_batch)
    if online:
        dwell = max(1.0, 0.8 * args.live_window_s)
        enc |= dict(online=True, online_batch=args.live_online_batch, online_window_s=args.live_window_s,
                    online_dwell_s=dwell)
    return stack.start(stack.deployment(model, grace_s=1.0, encode=enc), metrics=online)


def per_phase(reqs, results, phase_s: float, phases: int, limits) -> list[int]:
    """Requests that met both limits, by the phase they arrived in."""
    good = [0] * phases
    for (t, _), r in zip(reqs, results):
        if scoring.met(r, limits):
            good[min(phases - 1, int(t // phase_s))] += 1
    return good


def online_changes(st) -> dict:
    """The online encode's easerve:online_changes_total by knob and reason, and its B now."""
    changes, knobs = {}, {}
    for fam in stack.metric_families(st, "encode-0"):
        for s in fam.samples:
            if s.name == "easerve:online_changes_total":
                changes[f"{s.labels['knob']}:{s.labels['reason']}"] = int(s.value)
            elif s.name == "easerve:online_knob":
                knobs[s.labels["knob"]] = s.value
    return {"by_knob_reason": changes, "total": sum(changes.values()), "knobs_at_end": knobs}


def slo_limits(args, model: str, run, url: str) -> tuple[float, float]:
    if getattr(args, "profile", None):
        from easerve import profile_format as pf
        return pf.load(args.profile).slo(args.slo).limits("image")
    calib = [run(url, [(0.0, 910 + k)])[0][0] for k in range(args.live_calib)]  # one at a time: unloaded
    return scoring.unloaded_limits(calib, MODERATE)


def live(args) -> dict:
    """Run the live step; the dict merges into online_control's result."""
    t0 = time.perf_counter()
    model = checkpoint(args.live_model, args.live_cache_dir, scale="tiny" if args.quick else "bench")
    name = served_name(model)

    def run(url, reqs):
        return replay_images(url, name, [(t, png_uri(img, args.live_image_size)) for t, img in reqs],
                             args.live_max_tokens)

    ceiling = [int(b) for b in args.live_ceiling_batches.split(",") if b.strip()]
    arms = {"static": None, "online": None} | {f"static-b{b}": b for b in ceiling if b != args.live_batch}
    stacks = stack.start_all({arm: lambda on=arm == "online", b=b: start_stack(args, model, on, b)
                                  for arm, b in arms.items()})
    try:
        urls = {arm: st.endpoints.http for arm, st in stacks.items()}
        print(f"live: both stacks serving after {time.perf_counter() - t0:.0f} s", flush=True)
        for url in urls.values():
            run(url, [(0.1 * k, 800 + k) for k in range(2)])  # warm-up
        limits = slo_limits(args, model, run, urls["static"])
        burst, wall = run(urls["static"], [(0.0, 1000 + k) for k in range(args.live_burst)])
        capacity = sum(r.ok for r in burst) / wall
        mults = [float(x) for x in args.live_rates.split(",")]
        rates = [m * capacity for m in mults]
        reqs = trace(rates, args.live_phase_s, args.seed)
        print(f"live: capacity {capacity:.2f} req/s; step {', '.join(f'{r:.2f}' for r in rates)} req/s x "
              f"{args.live_phase_s:.0f} s ({len(reqs)} requests); SLO TTFT {limits[0]:.0f} ms, TPOT "
              f"{limits[1]:.1f} ms", flush=True)
        out, phases = {}, {}
        for arm in arms:
            results, _ = run(urls[arm], reqs)
            out[arm] = scoring.summary_with_refusals(results, limits, args.live_phase_s * len(rates))
            phases[arm] = per_phase(reqs, results, args.live_phase_s, len(rates), limits)
            print(f"live {arm}: {out[arm]}; good per phase {phases[arm]}", flush=True)
        changes = online_changes(stacks["online"])
    finally:
        stack.stop_all(stacks, grace_s=3.0)  # idle by now
    s = out["static"]["goodput_rps"]
    static_arms = [a for a in arms if a != "online"]
    best = sum(max(phases[a][p] for a in static_arms) for p in range(len(rates)))
    return {"online_over_static_live": round(out["online"]["goodput_rps"] / s, 3) if s else None,
            "ceiling_over_static_live": round(best / sum(phases["static"]), 3) if sum(phases["static"]) else None,
            "live": {"model": name, "capacity_rps": capacity, "rates_rps": rates, "phase_s": args.live_phase_s,
                     "requests": len(reqs), "slo_ttft_ms": limits[0], "slo_tpot_ms": limits[1],
                     "static_batch": args.live_batch, "online_batch": args.live_online_batch,
                     "static": out["static"], "online": out["online"], "changes": changes,
                     "arms": out, "good_per_phase": phases, "ceiling_batches": ceiling,
                     "wall_s": round(time.perf_counter() - t0, 1)}}
