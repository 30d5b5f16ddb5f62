"""The online controller (easerve/policy/online.py) against the static tuned deployment, in the
simulator (easerve.sim runs the live policy classes; easerve/sim/online.py drives the controller).

Profiles: the paper's models (bench/paper_models, roofline profiles on --gpu with tensor parallel
--tp, as bench/paper_setting.py builds them), or a measured profile (--profile FILE, e.g. the
bench-scale checkpoint's `hasctl profile`; --devices then names its devices).
Per profile:
1. static tuned: every E/P/D allocation of the --gpus GPU-equivalents x B in {1, 4, 8, 16}
   (co-located ones at s = 0.5), the best goodput in the simulator at the base rate (2 req/s per
   GPU-equivalent, Poisson, --tune-requests requests);
2. traces (req/s per GPU-equivalent x the GPU-equivalents): a rate step 2 -> 6 -> 2 (--phase-s
   each) and a diurnal curve from 1 to 6 and back (--period-s, as 40 constant segments);
3. three runs of each trace: static (the tuned deployment as it is), online (the controller moves
   B, s and the partition tolerance, and re-balances instances between the stages within the
   --gpus / --tp GPU-equivalents the static deployment was tuned on: a stage that wants more takes one from the
   least utilized stage that can spare one; "online_same": within the static deployment's own
   instance count, when the tuner left GPU-equivalents idle at the base rate) and autoscale (the controller also adds and drains
   instances per stage within --autoscale MIN:MAX on fresh GPU-equivalents; its GPU-seconds are
   reported).
Goodput: requests meeting the profile's --slo tier (TTFT and TPOT) per second of the trace.
Last stdout line: JSON with "online_over_static_sim" (the step, the worst profile),
"online_same_instances_over_static_sim",
"autoscale_over_static_sim", "changes_per_hour" (the most of any online run), "changes_per_hour_bound"
(3600 / dwell per knob x knobs), "diurnal_online_over_static_sim", "diurnal_autoscale_over_static_sim"
and "cells" (every run's figures).

Live (--live, bench/online_live.py): one rate step on this machine, the bench-scale checkpoint
served static and with encode --online; adds "online_over_static_live" and "live" (--no-sim: the
live part alone).

  python bench/online_control.py --quick          # image only, shorter traces
  python bench/online_control.py --live --no-sim  # the live step alone (~8 min here)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.results import add_save_flag, finish  # noqa: E402

from bench import online_live  # noqa: E402
from easerve.policy.online import OnlineBounds, OnlineConfig  # noqa: E402
from easerve.roofline import load_spec  # noqa: E402
from easerve.sim import SimRequest  # noqa: E402
from easerve.policy.service_model import ModelConfig  # noqa: E402
from easerve.sim.online import OnlineDriver  # noqa: E402
from easerve.sim.workload import piecewise_poisson  # noqa: E402
from easerve import profile_format as pf  # noqa: E402
from hasctl.bench import BenchConfig  # noqa: E402
from easerve.slo import RequestRecord  # noqa: E402
from hasctl.roofline_profile import build  # noqa: E402
from hasctl.simulate import media_of, run_simulation, template_tokens  # noqa: E402
from hasctl.tune_space import Space, deployment_for, runnable_allocations  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

MODELS = {"image": "llava-v1.6-34b", "video": "qwen2.5-vl-32b", "audio": "ultravox-27b"}
WORKLOAD = dict(image_size=(672, 672), video_frames=16, video_size=(448, 448), audio_s=10.0, input_tokens=32,
                output_tokens=128)
STEP = (2.0, 6.0, 2.0)        # req/s per GPU-equivalent
DIURNAL = (1.0, 6.0)
BATCHES = (1, 4, 8, 16)
ARMS = ("online", "online_same", "autoscale")
ONE_NODE = ModelConfig(devices_per_host=256)  # the paper's 8 GPUs and any added ones: one node


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default="image,video,audio", help="paper models to run (with no --profile)")
    ap.add_argument("--profile", default=None, help="a measured profile instead of the paper models")
    ap.add_argument("--devices", default=None, help="with --profile: its devices (default: the profile's)")
    ap.add_argument("--gpu", default="rtx6000-ada")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs of the paper setting")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel: GPU-equivalents = gpus / tp")
    ap.add_argument("--rate-unit", type=float, default=None,
                    help="req/s that '1 per GPU-equivalent' means (default: 1, or for a profile whose base rate "
                         "the tuned deployment cannot carry, a third of its capacity per GPU-equivalent)")
    ap.add_argument("--phase-s", type=float, default=300.0, help="length of each phase of the rate step")
    ap.add_argument("--period-s", type=float, default=1200.0, help="length of the diurnal curve")
    ap.add_argument("--tune-requests", type=int, default=150)
    ap.add_argument("--autoscale", default="1:4", help="MIN:MAX instances per stage for the autoscale runs")
    ap.add_argument("--slo", default="moderate", choices=["tight", "moderate", "loose"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result JSON here too")
    ap.add_argument("--quick", action="store_true", help="image only, 120 s phases, 480 s diurnal; --live: the "
                    "tiny checkpoint, 8 s phases (a smoke run)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator part (with --live)")
    online_live.add_args(ap)
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.no_sim and not args.live:
        ap.error("--no-sim leaves nothing to run; add --live")
    if args.quick:
        args.modalities, args.phase_s, args.period_s, args.tune_requests = "image", 120.0, 480.0, 80
        online_live.quick(args)
    args.modalities = [m for m in args.modalities.split(",") if m]
    lo, _, hi = args.autoscale.partition(":")
    args.scale = (int(lo), int(hi))
    return args


# ---- workloads --------------------------------------------------------------------------------------
def step_segments(phase_s: float) -> list[tuple[float, float]]:
    return [(phase_s, r) for r in STEP]


def diurnal_segments(period_s: float, n: int = 40) -> list[tuple[float, float]]:
    lo, hi = DIURNAL
    return [(period_s / n, lo + (hi - lo) * (1 - math.cos(2 * math.pi * (i + 0.5) / n)) / 2) for i in range(n)]


def requests(segments, scale: float, spec: WorkloadSpec, prof, seed: int) -> list[SimRequest]:
    times = piecewise_poisson([(d, r * scale) for d, r in segments], seed)
    media, text = media_of(spec, spec.modality), spec.input_tokens + template_tokens(prof)
    return [SimRequest(i, t, spec.modality, media, text, spec.output_tokens) for i, t in enumerate(times)]


def bench_config(spec: WorkloadSpec, slo, n: int) -> BenchConfig:
    return BenchConfig(url="http://simulated.invalid", rate=1.0, num_requests=max(1, n), seed=0, workload=spec,
                       ignore_eos=True, slo=slo, progress=False)


def run(d, prof, spec, slo, reqs, duration: float, driver=None) -> dict:
    bench, res = run_simulation(d, prof, bench_config(spec, slo, len(reqs)), ONE_NODE, online=driver, requests=reqs)
    met = sum(slo.met(RequestRecord.from_dict(r)) for r in res.records)
    out = {"goodput": met / duration, "met": met, "sent": len(reqs),
           "failed": sum(r["error"] is not None for r in res.records), "wall_s": round(res.wall_seconds, 2)}
    if driver is not None:
        out |= {"changes": len(driver.changes), "changes_per_hour": len(driver.changes) * 3600 / duration,
                "instance_actions": len(driver.actions), "gpu_seconds": round(driver.gpu_seconds, 1),
                "log": [f"{c.at:.0f}s {c.knob} {c.old}->{c.new} {c.reason}" for c in driver.changes]}
    return out


# ---- the static tuned deployment ----------------------------------------------------------------------
def tune_static(model: str, prof, spec, slo, devices: list[str], rate: float, args):
    space = Space(tuple(a for a in runnable_allocations(len(devices))), tuple(devices), BATCHES, monolith=False,
                  batch_modes=("adaptive",))
    segs = [(args.tune_requests / rate, rate)]
    reqs = requests(segs, 1.0, spec, prof, args.seed + 1)
    best = None
    for a in space.allocations:
        for b in BATCHES:
            params = {"alloc": a.name, "B": b, **({"s": 0.5} if a.colocated else {})}
            d = deployment_for(space, params, model, "static-tuned")
            g = run(d, prof, spec, slo, reqs, segs[0][0])["goodput"]
            if best is None or g > best[0]:
                best = (g, d, params)
    return best


def online_config(args, instances: tuple[int, int]) -> OnlineConfig:
    return OnlineConfig(bounds=OnlineBounds(min_batch=1, max_batch=32, min_instances=instances[0],
                                            max_instances=instances[1]),
                        window_s=20.0, interval_s=2.0, dwell_s=30.0, reversal_dwell_s=120.0)


def profiles(args):
    """(label, model folder, profile, devices) per profile to run."""
    if args.profile:
        prof = pf.load(args.profile)
        devices = args.devices.split(",") if args.devices else list(prof.hardware.devices)
        yield "profile", prof.model.path, prof, devices
        return
    spec_dev = load_spec(args.gpu)
    devices = [f"cuda:{i}" for i in range(args.gpus // args.tp)]
    for m in args.modalities:
        model = str(ROOT / "bench" / "paper_models" / MODELS[m])
        yield m, model, build(model, spec_dev, args.tp), devices


def main(argv=None) -> int:
    args = args_of(argv)
    t0 = time.monotonic()
    cells, ratios = [], {"step": {}, "diurnal": {}}
    for label, model, prof, devices in ([] if args.no_sim else profiles(args)):
        modality = label if label in MODELS else prof.model.modalities[0]
        spec = WorkloadSpec(modality=modality, **WORKLOAD)
        slo = prof.slo(args.slo)
        unit = args.rate_unit or 1.0
        base = STEP[0] * unit * len(devices)
        g, static, params = tune_static(model, prof, spec, slo, devices, base, args)
        if args.rate_unit is None and g < 0.8 * base:  # the base rate is past what the deployment carries:
            unit = 0.7 * max(g, 1e-3) / (STEP[0] * len(devices))  # rescale so the base is ~70 % of what it met
            base = STEP[0] * unit * len(devices)
            g, static, params = tune_static(model, prof, spec, slo, devices, base, args)
        print(f"{label}: static tuned {params} at {base:.2f} req/s: goodput {g:.2f}", flush=True)
        scale = unit * len(devices)
        for trace, segs in (("step", step_segments(args.phase_s)), ("diurnal", diurnal_segments(args.period_s))):
            reqs = requests(segs, scale, spec, prof, args.seed)
            dur = sum(d for d, _ in segs)
            held = sum(len(getattr(static, st)) for st in ("encode", "prefill", "decode", "monolith"))
            res = {"static": run(static, prof, spec, slo, reqs, dur),
                   "online": run(static, prof, spec, slo, reqs, dur,
                                 OnlineDriver(online_config(args, (1, len(devices))), budget=len(devices))),
                   "online_same": run(static, prof, spec, slo, reqs, dur,
                                      OnlineDriver(online_config(args, (1, held)), budget=held)),
                   "autoscale": run(static, prof, spec, slo, reqs, dur,
                                    OnlineDriver(online_config(args, args.scale), autoscale=True))}
            s = max(res["static"]["goodput"], 1e-9)
            r = {k: res[k]["goodput"] / s for k in ARMS}
            ratios[trace][label] = r
            cells.append({"profile": label, "trace": trace, "rate_unit": unit, "static_params": params, **res})
            print(f"  {trace:<8} goodput static {res['static']['goodput']:.2f}  online {res['online']['goodput']:.2f} "
                  f"({r['online']:.2f}x, {res['online']['changes']} changes, {res['online']['instance_actions']} "
                  f"instance moves; with the static's {held} instances {r['online_same']:.2f}x)  autoscale "
                  f"{res['autoscale']['goodput']:.2f} ({r['autoscale']:.2f}x, {res['autoscale']['changes']} changes, "
                  f"{res['autoscale']['gpu_seconds']:.0f} GPU-s vs {len(devices) * dur:.0f})", flush=True)
            for arm in ("online", "autoscale"):
                print(f"    {arm}: " + "; ".join(res[arm]["log"][:14]), flush=True)
    result = sim_result(args, cells, ratios) if cells else {}
    if args.live:
        result |= online_live.live(args)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finish("online_control", args, result, argv)
    return 0


def sim_result(args, cells: list[dict], ratios: dict) -> dict:
    cfg = online_config(args, args.scale)
    per_hour = max(c[k]["changes_per_hour"] for c in cells for k in ARMS)
    return {
        "online_over_static_sim": round(min(r["online"] for r in ratios["step"].values()), 3),
        "online_same_instances_over_static_sim": round(min(r["online_same"] for r in ratios["step"].values()), 3),
        "autoscale_over_static_sim": round(min(r["autoscale"] for r in ratios["step"].values()), 3),
        "changes_per_hour": round(per_hour, 1),
        "changes_per_hour_bound": round(6 * 3600 / cfg.dwell_s),
        "diurnal_online_over_static_sim": round(min(r["online"] for r in ratios["diurnal"].values()), 3),
        "diurnal_autoscale_over_static_sim": round(min(r["autoscale"] for r in ratios["diurnal"].values()), 3),
        "by_profile": ratios,
        "cells": [{k: v for k, v in c.items() if k != "log"} | {a: {k: v for k, v in c[a].items() if k != "log"}
                                                                 for a in ("static", *ARMS)}
                  for c in cells]}


if __name__ == "__main__":
    sys.exit(main())
