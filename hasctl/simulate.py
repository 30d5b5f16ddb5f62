"""`hasctl simulate`: predict what `hasctl bench` would measure on a deployment, in the
discrete-event simulator (`easerve.sim`) with service times from a profile file.

Same workload flags, same seeded arrival times and modalities as `hasctl bench`, the same
result fields (per-request records too, `endpoint` says "simulated"), so `hasctl report` plots
simulated and measured runs side by side; plus each encode instance's utilization trace in the
format of the encode service's GET /trace (--trace, default next to --out).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from easerve.sim import SimRequest, Topology, simulate
from easerve.policy.service_model import ModelConfig
from hasctl.bench import (
    BenchConfig,
    BenchResult,
    add_workload_args,
    count_from_args,
    slo_from_args,
    summary,
    workload_from_args,
)
from easerve.slo import SLO, RequestRecord, compute_metrics
from hasctl.deployment import STAGES, Deployment, stage_config, preset
from easerve.stages.encode.profiler import media_label
from hasctl.workload import WorkloadSpec, arrival_times, load_dataset, modalities

ENDPOINT = "simulated"
_ADDR = ("127.0.0.1:1",)  # placeholder peer addresses: the configs demand them, the simulator ignores them
PROFILE_TEXT_TOKENS = 32  # words of text hasctl profile's unloaded request sends


def topology(d: Deployment, gpu_kv_gib: float | None = None) -> Topology:
    """The deployment's stage configs, built and checked as its processes would build them;
    `gpu_kv_gib`: a decode GPU's KV budget (default: the simulator's DEFAULT_GPU_KV_GB)."""
    model = d.model or "model"
    wiring = {"decode": {}, "monolith": {}, "prefill": {"decode": _ADDR},
              "encode": {"prefill": _ADDR if d.prefill else (), "decode": _ADDR}}
    cfgs = {s: tuple(stage_config(s, {"model": model, "device": w.device, **wiring[s]}, w.flags, f"{s}[{i}]")
                     for i, w in enumerate(getattr(d, s))) for s in STAGES}
    gw = stage_config("gateway", {"model": model, "prefill": _ADDR, "decode": _ADDR}, d.gateway.flags, "gateway")
    return Topology(gw, cfgs["encode"], cfgs["prefill"], cfgs["decode"], cfgs["monolith"],
                    tp={s: tuple(w.tp for w in getattr(d, s)) for s in STAGES},
                    **({"gpu_kv_gb": gpu_kv_gib} if gpu_kv_gib else {}))


def media_of(spec: WorkloadSpec, modality: str) -> str:
    if modality == "image":
        return media_label("image", spec.image_size)
    if modality == "video":
        return media_label("video", (spec.video_frames, *spec.video_size))
    if modality == "audio":
        return media_label("audio", spec.audio_s)
    return ""


def template_tokens(profile) -> int:
    """Prompt tokens the chat template adds: the profile's unloaded text request less its words."""
    try:
        return max(0, profile.unloaded_for("text").prompt_tokens - PROFILE_TEXT_TOKENS)
    except ValueError:
        return 0


def sim_requests(config: BenchConfig, profile) -> list[SimRequest]:
    """The requests `hasctl bench` would send for `config` (same seeded times and modalities)."""
    times = arrival_times(config.rate, config.burstiness, config.seed, n=config.num_requests,
                          duration_s=config.duration_s)
    extra, spec = template_tokens(profile), config.workload
    if config.dataset:
        given = load_dataset(config.dataset, spec.output_tokens)
        out = []
        for i, t in enumerate(times):
            r = given[i % len(given)]
            words = sum(len(str(p.get("text", "")).split()) if isinstance(p, dict) else 0
                        for m in r.messages for p in (m["content"] if isinstance(m.get("content"), list)
                                                      else [{"text": m.get("content", "")}]))
            mod = r.modality if r.modality in ("image", "video", "audio") else "text"
            out.append(SimRequest(i, t, mod, media_of(spec, mod), max(1, words) + extra, r.max_tokens))
        return out
    return [SimRequest(i, t, m, media_of(spec, m), spec.input_tokens + extra, spec.output_tokens)
            for i, (t, m) in enumerate(zip(times, modalities(spec, len(times), config.seed)))]


def run_simulation(d: Deployment, profile, config: BenchConfig, model: ModelConfig | None = None,
                   tp_profiles=(), online=None, requests: list[SimRequest] | None = None, service_model=None):
    """(BenchResult in hasctl bench's fields, the simulator's SimResult). A worker with `tp: k`
    takes its service times from the profile of `profile` and `tp_profiles` whose tp is k; a
    roofline profile's `kv_gib_per_device` sizes the decode KV caches.
    `online`: an easerve.sim.online.OnlineDriver; `requests`: instead of config's seeded workload;
    `service_model`: service times other than the profile's (bench/fidelity_replay.py MeasuredModel)."""
    reqs = sim_requests(config, profile) if requests is None else requests
    kv = profile.roofline.kv_gib_per_device if getattr(profile, "roofline", None) is not None else None
    result = simulate(topology(d, kv), profile, reqs, model, tp_profiles, online, service_model=service_model)
    records = [RequestRecord.from_dict(r) for r in result.records]
    metrics = compute_metrics(records, config.slo)
    return BenchResult(config, profile.model.path, metrics, records), result


def bench_config(args, slo: SLO | None, label: str) -> BenchConfig:
    return BenchConfig(url="http://simulated.invalid", rate=args.rate, burstiness=args.burstiness,
                       num_requests=count_from_args(args), duration_s=args.duration, seed=args.seed,
                       workload=workload_from_args(args), dataset=args.dataset, ignore_eos=args.ignore_eos,
                       slo=slo, label=label, progress=False)


# ---- command line ----------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict hasctl bench's result for a deployment in the simulator")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--deployment", help="deployment file (.yaml / .json)")
    where.add_argument("--preset", help="a named deployment (default, colocated, dynamo-like, monolith, ...)")
    add_workload_args(p)  # --profile among them: here it also gives the service times (required)
    p.add_argument("--devices-per-host", type=int, default=8, help="GPUs per node (cuda:N is on node N // this)")
    p.add_argument("--tp-profile", action="append", default=[], metavar="FILE",
                   help="a profile taken with another --tp, for the deployment's workers of that tp (repeatable; "
                        "--profile serves the workers of its own tp)")
    p.add_argument("--request-overhead-ms", type=float, default=0.0,
                   help="what the live stack adds to each request outside the profiled calls (HTTP, gRPC hops): "
                        "a delay before the gateway takes it (bench/sim_fidelity.py measures it per stack)")
    p.add_argument("--host-work", default=None, metavar="FILE",
                   help="host CPU per request per stage (hasctl profile --host-work), charged as core time")
    p.add_argument("--label", default="", help="name recorded for hasctl report (default: the deployment's)")
    p.add_argument("--trace", default=None, help="encode utilization traces (default: OUT with .trace.json)")
    p.add_argument("--out", required=True, help="result JSON (hasctl bench's fields)")
    p.set_defaults(func=run)


def run(args) -> int:
    from easerve.profile_format import load
    if not args.profile:
        raise ValueError("hasctl simulate needs --profile PROFILE.json (its service times)")
    profile = load(args.profile)
    d = Deployment.load(args.deployment) if args.deployment else preset(args.preset)
    config = bench_config(args, slo_from_args(args), args.label or d.name)
    extra = [load(p) for p in args.tp_profile]
    host_s = ()
    if args.host_work:
        from hasctl import profile_host
        host_s = profile_host.host_s_for(profile_host.load(args.host_work), d, profile, config.workload.modality)
    model = ModelConfig(args.devices_per_host, request_overhead_s=args.request_overhead_ms / 1e3, host_s=host_s)
    bench, result = run_simulation(d, profile, config, model, extra)
    doc = bench.to_dict()
    doc["endpoint"] = ENDPOINT
    doc["simulated"] = {"profile": str(args.profile), "tp_profiles": list(args.tp_profile),
                        "deployment": d.to_dict(), "sim_seconds": result.sim_seconds,
                        "wall_seconds": result.wall_seconds, "events": result.events,
                        "sim_seconds_per_wall_second": result.speed, "busy_s": result.busy_s}
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    trace = Path(args.trace) if args.trace else out.with_suffix(".trace.json")
    trace.write_text(json.dumps(result.traces, indent=1, allow_nan=False) + "\n")
    print(summary(bench.metrics), flush=True)
    print(f"simulated {result.sim_seconds:.1f} s in {result.wall_seconds:.2f} s wall: "
          f"{result.speed:.1f} simulated seconds per wall second ({result.events} events); "
          f"wrote {out} and {trace}", file=sys.stderr, flush=True)
    return 0
