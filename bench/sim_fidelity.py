"""How close the simulator (`hasctl simulate`, `easerve.sim`) comes to live runs on this machine,
with the live noise measured beside the error so the two can be told apart.

Per modality, on its bench-scale checkpoint (`hasctl make-tiny --scale bench`; image on
Qwen2.5-VL, audio on Ultravox), for each deployment (image: dynamo-like, default, colocated,
monolith and bench/deployments/two-decode.yaml; audio: default and dynamo-like):

1. profile: `hasctl profile` of the checkpoint (reused from the run folder when there);
   host work: `hasctl.profile_host.measure_host_work` on the family's tiny checkpoint (negligible
   compute) for the `default` and `monolith` stacks, the simulator's per-stage core time
   (`ModelConfig.host_s`; E/P/D deployments take default's stages, a monolith the monolith's);
2. blocks, interleaved across deployments (ABCABC: repeat k of every deployment before repeat
   k+1 of any), each on a fresh stack: the load average and CPU steal logged before it; a
   warm-up; a fresh probe (`--probe-s` of lone requests, seed 500+: their median TTFT over the
   simulator's for the same request is the deployment's residual per-request delay
   `request_overhead_s`, fitted on those seeds and never on a cell's); in the first block the
   live capacity: an open loop at 2x the larger of the simulated capacity and the throughput of
   a closed loop of 16 in flight, for `--capacity-s`, completions per
   second in its steady window (first and last 15 % dropped); then the cells at 0.5x and 0.8x
   of that live capacity (at least `--cell-s` of arrivals and `--min-requests`), each with media
   of its own, and in the first block one overload cell at 1.5x, scored apart; a cell run while
   the machine's steal time was over 5 % is flagged and run again once;
3. the simulated side of every cell: its own BenchConfig (same seed, arrivals, sizes, SLO)
   through `run_simulation` with the deployment's host work and residual delay; the simulated
   capacity the same open loop, scored the same way;
4. scoring (bench/fidelity_score.py): per cell the live mean and a bootstrap 95 % interval over
   the repeats, the simulated value, whether it lies inside the interval widened by 5 %, its
   bias (log sim / live) and excess error; the same figures for each live repeat against the
   others (`live_vs_live`); rank agreement over the deployment pairs whose live intervals do not
   overlap; and, from the live call spans (bench/fidelity_replay.py), the service-time error per
   stage and the error of a replay of the live arrivals with the measured call times; and where
   the time to first token went: each cell's per-request phases as the live gateway counts them
   (its easerve:stage_latency_seconds and TTFT between the cell's start and end: preprocess,
   encode queue, encode, prefill, embed_transfer, ttft) beside the simulator's and the replay's
   (easerve/sim/phases.py), the median log ratio per phase over the cells.

Last stdout line: JSON with "capacity_bias_max", "capacity_bias" (per deployment),
"coverage", "bias_median", "excess_median", "service_time_err_median", "replay_ttft_p50_err_median",
"rank_agreement_separable" (and "separable_pairs"), "overload" (cells scored apart),
"live_vs_live", "phase_bias" and "replay_phase_bias" (phase -> median log(sim / live)),
"miss_from" (service time, queueing or policy), "flagged", "minutes".

  python bench/sim_fidelity.py                                   # the whole run (~75 min here)
  python bench/sim_fidelity.py --modalities image --deployments default,dynamo-like,monolith
  python bench/sim_fidelity.py --quick                           # CI smoke: tiny, 2 deployments, 1 repeat
  python bench/sim_fidelity.py --resim runs/sim-fidelity         # re-simulate a finished run (seconds)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import fidelity_score as fs  # noqa: E402
from bench import sim_fidelity_resim as store  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402

from hasctl.bench import BenchConfig, run_bench  # noqa: E402
from hasctl.deployment import Deployment, preset  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

FAMILIES = {"image": "qwen2.5-vl", "audio": "ultravox"}
DEPLOYMENTS = {"image": ("dynamo-like", "default", "colocated", "monolith", "bench/deployments/two-decode.yaml"),
               "audio": ("default", "dynamo-like")}
QUICK_DEPLOYMENTS = ("default", "monolith")
LOADS = (0.5, 0.8)
OVERLOAD = 1.5
CAPACITY_OVER_SIM = 2.0   # the capacity run's rate: this x the larger of the simulated capacity and a live closed loop's
CONTENT_SEED = 10_000     # + 100 x repeat + cell: each live run's media
PROBE_SEED = 500
STEAL_FLAG = 0.05


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default="image,audio", help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--deployments", default=None,
                    help="comma-separated presets or deployment files, for every modality (default: per modality)")
    ap.add_argument("--repeats", type=int, default=3, help="live repeats of each cell, interleaved across deployments")
    ap.add_argument("--capacity-s", type=float, default=90.0, help="seconds of arrivals of the capacity run")
    ap.add_argument("--cell-s", type=float, default=60.0, help="least seconds of arrivals of a cell")
    ap.add_argument("--min-requests", type=int, default=150, help="least requests of a cell")
    ap.add_argument("--probe-s", type=float, default=10.0, help="seconds of lone requests of each block's probe")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--slo", default="moderate", choices=["tight", "moderate", "loose"], help="profile SLO tier")
    ap.add_argument("--host-requests", type=int, default=40, help="requests of each host-work measurement")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the checkpoints are built")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "sim-fidelity"), help="run folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resim", default=None, metavar="DIR",
                    help="re-simulate and re-score the finished run folder DIR with the current simulator (no live run)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny checkpoint, image on default and monolith, 1 repeat, short cells")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    args.modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    bad = [m for m in args.modalities if m not in FAMILIES]
    if bad:
        ap.error(f"--modalities: {bad} unknown; choose from {sorted(FAMILIES)}")
    args.scale = "bench"
    if args.quick:
        args.scale, args.modalities, args.repeats = "tiny", ["image"], 1
        args.capacity_s, args.cell_s, args.min_requests, args.probe_s = 8.0, 5.0, 10, 2.0
        args.output_tokens, args.host_requests = 8, 8
        args.deployments = args.deployments or ",".join(QUICK_DEPLOYMENTS)
    args.by_modality = {m: tuple(x.strip() for x in args.deployments.split(",")) if args.deployments
                        else DEPLOYMENTS[m] for m in args.modalities}
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    args.out_dir = Path(args.out_dir)
    return args


def deployment(name: str) -> Deployment:
    return Deployment.load(ROOT / name) if name.endswith((".yaml", ".json")) else preset(name)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the machine's state --------------------------------------------------------------------------
def cpu_ticks() -> tuple[int, int]:
    """(all, steal) jiffies of /proc/stat's cpu line."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(f), (f[7] if len(f) > 7 else 0)


def steal_share(t0: tuple[int, int], t1: tuple[int, int]) -> float:
    return (t1[1] - t0[1]) / max(1, t1[0] - t0[0])


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# ---- 1. checkpoint, profile, host work -----------------------------------------------------------
def profile_of(args, model: str, modality: str):
    from easerve.profile_format import REVISION, load
    import subprocess
    path = args.out_dir / f"profile-{FAMILIES[modality]}-{args.scale}{'-quick' if args.quick else ''}.json"
    if path.is_file() and load(path).revision >= REVISION:
        say(f"[{modality}] reusing {path}")
        return load(path), path
    say(f"[{modality}] hasctl profile {model} -> {path}")
    cmd = [sys.executable, "-m", "hasctl.cli", "profile", "--model", model, "--out", str(path), "--no-progress"]
    subprocess.run(cmd + (["--quick", "--repeats", "3"] if args.quick else []), check=True, cwd=ROOT)
    return load(path), path


def workload(args, profile, modality: str) -> WorkloadSpec:
    size = store.media_label(profile, modality)
    if modality == "image":
        w, h = (int(x) for x in (size or "224x224").split("x"))
        return WorkloadSpec(modality="image", image_size=(w, h), output_tokens=args.output_tokens)
    return WorkloadSpec(modality="audio", audio_s=float((size or "2s").rstrip("s")), output_tokens=args.output_tokens)


def host_work(args, modality: str, spec: WorkloadSpec) -> dict:
    """hasctl.profile_host.measure_stacks on the family's tiny checkpoint, cached in the run folder."""
    from hasctl.profile_host import measure_stacks
    path = args.out_dir / f"host-{FAMILIES[modality]}.json"
    if path.is_file():
        say(f"[{modality}] reusing {path}")
        return json.loads(path.read_text())
    tiny = checkpoint(None, args.cache_dir, FAMILIES[modality], "tiny")
    out = measure_stacks(tiny, spec, args.out_dir / "host", requests=args.host_requests)
    for name in ("default", "monolith"):
        say(f"[{modality}] host work per request ({name}, tiny checkpoint): "
            + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in out[name]["host_s"].items()))
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def host_s_of(d: Deployment, ctx: dict) -> tuple[tuple[str, float], ...]:
    from hasctl.profile_host import host_s_for
    return host_s_for(ctx["host"], d, ctx["profile"], ctx["modality"])


def model_config(host_s, overhead_s: float):
    from easerve.policy.service_model import ModelConfig
    return ModelConfig(host_s=tuple(host_s), request_overhead_s=max(0.0, overhead_s))


# ---- 2. live blocks ------------------------------------------------------------------------------
def config(spec, slo, rate: float, n: int, seed: int, url="http://simulated.invalid", content_seed=None, label=""):
    return BenchConfig(url=url, rate=rate, num_requests=n, seed=seed, workload=spec, ignore_eos=True, slo=slo,
                       label=label, progress=False, content_seed=content_seed)


def cell_requests(args, rate: float) -> int:
    return max(args.min_requests, math.ceil(rate * args.cell_s))


def sim_capacity(d, profile, spec, slo, args, mc) -> float:
    from hasctl.simulate import run_simulation
    burst = config(spec, slo, 1000.0, max(40, args.min_requests // 2), args.seed)
    return run_simulation(d, profile, burst, mc)[0].metrics["request_throughput"]


def probe(d, profile, spec, slo, url: str, args, host_s) -> dict:
    """Lone requests for --probe-s: the residual delay of the stack over the simulator's unloaded TTFT."""
    from hasctl.simulate import run_simulation
    live, k, t0 = [], 0, time.monotonic()
    while time.monotonic() - t0 < args.probe_s or k < 2:
        m = asyncio.run(run_bench(config(spec, slo, 1.0, 1, args.seed + PROBE_SEED + k, url))).metrics
        if m.get("median_ttft_ms") is not None:
            live.append(m["median_ttft_ms"])
        k += 1
    sim = run_simulation(d, profile, config(spec, slo, 1.0, 1, args.seed + PROBE_SEED), model_config(host_s, 0.0))
    sim_ms = sim[0].metrics["median_ttft_ms"]
    med = statistics.median(live) if live else sim_ms
    return {"live_ttft_ms": round(med, 2), "samples": len(live), "sim_ttft_ms": round(sim_ms, 2),
            "overhead_s": round(max(0.0, med - sim_ms) / 1e3, 5)}


def run_live(url: str, cfg: BenchConfig, path: Path, args, spans: bool, stack) -> dict:
    """One live cell (re-run once when steal time was over STEAL_FLAG); its result file, with
    `spans` its stages' call spans beside it, and flags."""
    from bench import fidelity_replay as fr
    for attempt in range(2):
        before = gateway_phases(stack)
        t0, since = cpu_ticks(), time.monotonic()
        res = asyncio.run(run_bench(cfg))
        steal = steal_share(t0, cpu_ticks())
        if steal <= STEAL_FLAG or attempt:
            break
        say(f"    steal {steal:.1%} during the cell: run again")
    path.write_text(res.to_json())
    if spans:
        got = fr.collect_spans(stack.endpoints.metrics, since=since, last=1000)
        path.with_name(path.stem + "-spans.json").write_text(json.dumps(store.spans_to_json(got)) + "\n")
    return {"file": path.name, "steal": round(steal, 4), "flagged": steal > STEAL_FLAG,
            "phases_ms": fr.phase_means_ms(before, gateway_phases(stack))}


def gateway_phases(stack) -> dict:
    """The stack's gateway's per-request phase totals now (bench/fidelity_replay.py
    phase_totals; {} when it does not answer)."""
    from bench import fidelity_replay as fr
    from bench.harness.stack import metric_families
    try:
        return fr.phase_totals(metric_families(stack, "gateway"))
    except OSError:
        return {}


def live_capacity(url: str, d, profile, spec, slo, args, mc, path: Path, stack) -> dict:
    """The live capacity of the stack at `url`: an open loop at CAPACITY_OVER_SIM x the larger of
    the simulated capacity and a closed loop's throughput (16 in flight), for --capacity-s,
    completions per second in its steady window; the run is kept at `path`."""
    from easerve.slo import RequestRecord
    burst = asyncio.run(run_bench(BenchConfig(url=url, rate=1e6, num_requests=max(16, args.min_requests // 4),
                                              max_concurrency=16, seed=args.seed + 8, workload=spec,
                                              ignore_eos=True, progress=False, content_seed=CONTENT_SEED - 2)))
    closed = burst.metrics["request_throughput"]
    rate = CAPACITY_OVER_SIM * max(closed, sim_capacity(d, profile, spec, slo, args, mc))
    cap = config(spec, slo, rate, math.ceil(rate * args.capacity_s), args.seed + 7, url, CONTENT_SEED - 1)
    run = run_live(url, cap, path, args, False, stack)
    recs = [RequestRecord.from_dict(r) for r in json.loads(path.read_text())["records"]]
    return {"closed": round(closed, 3), "rate": rate, "run": run, "capacity": fs.steady_capacity(recs)}


def run_block(args, k: int, modality: str, name: str, ctx: dict, state: dict) -> None:
    """Repeat k of one deployment on a fresh stack (see the module docstring, step 2)."""
    from hasctl.launch import Stack
    from hasctl.trials import stop_uninterrupted
    d, spec, slo, profile = deployment(name), ctx["spec"], ctx["slo"], ctx["profile"]
    run_dir = args.out_dir / modality / d.name
    run_dir.mkdir(parents=True, exist_ok=True)
    st = state.setdefault(d.name, {"blocks": [], "cells": {}})
    host_s = host_s_of(d, ctx)
    block = {"repeat": k, "load_average": load_average(), "started": time.strftime("%H:%M:%S")}
    stack = Stack(d.with_model(ctx["model"]).with_gateway_ports(0, 0), run_dir=run_dir / f"stack{k}",
                  env={"EASERVE_LOG_LEVEL": "WARNING"}, metrics=True)
    try:
        stack.start(timeout=600)
        url = stack.endpoints.http
        asyncio.run(run_bench(config(spec, slo, 4.0, 3, args.seed + 999, url)))
        block["probe"] = probe(d, profile, spec, slo, url, args, host_s)
        if k == 0:
            st["overhead_s"] = block["probe"]["overhead_s"]
            mc = model_config(host_s, st["overhead_s"])
            cap = live_capacity(url, d, profile, spec, slo, args, mc, run_dir / "capacity.json", stack)
            block["closed_loop_rps"], st["capacity_run"], st["live_capacity"] = cap["closed"], cap["run"], cap["capacity"]
            say(f"  {d.name}: live capacity {cap['capacity']:.3f} req/s (open loop at {cap['rate']:.2f})")
        loads = LOADS + ((OVERLOAD,) if k == 0 else ())
        for j, load in enumerate(loads):
            rate = round(load * st["live_capacity"], 4)
            cfg = config(spec, slo, rate, cell_requests(args, rate), args.seed + j, url, CONTENT_SEED + 100 * k + j,
                         d.name)
            info = run_live(url, cfg, run_dir / f"live-r{k}-{load:g}.json", args, k == 0 and load != OVERLOAD, stack)
            st["cells"].setdefault(f"{load:g}", []).append(info)
            say(f"  r{k} {d.name:12s} {load:g}x = {rate:.3f} req/s done{' (flagged)' if info['flagged'] else ''}")
    finally:
        stop_uninterrupted(stack)
    st["blocks"].append(block)


# ---- 3, 4. simulate and score ----------------------------------------------------------------------
def records_of(path: Path):
    from easerve.slo import RequestRecord
    doc = json.loads(path.read_text())
    return doc, [RequestRecord.from_dict(r) for r in doc["records"]]


def score_deployment(args, modality: str, name: str, ctx: dict, st: dict) -> dict:
    from hasctl.simulate import run_simulation
    config_of = store.config_of
    d = deployment(name)
    run_dir = args.out_dir / modality / d.name
    mc = model_config(host_s_of(d, ctx), st["overhead_s"])
    profile, slo = ctx["profile"], ctx["slo"]
    cap_doc, _ = records_of(run_dir / "capacity.json")
    sim_cap_res = run_simulation(d, profile, config_of(cap_doc), mc)[0]
    sim_cap = fs.steady_capacity(sim_cap_res.records)
    out = {"live_capacity": round(st["live_capacity"], 4), "sim_capacity": round(sim_cap, 4),
           "capacity_bias": round(fs.log_ratio(sim_cap, st["live_capacity"]), 4), "cells": {}}
    for load, infos in st["cells"].items():
        docs = [records_of(run_dir / i["file"]) for i in infos]
        cfg = config_of(docs[0][0])
        rate = cfg.rate
        outcomes = [fs.steady_outcomes(recs, slo) for _, recs in docs]
        sim_res, sim_run = run_simulation(d, profile, cfg, mc)
        (run_dir / f"sim-{load}.json").write_text(sim_res.to_json())
        sim_good = fs.steady_goodput(sim_res.records, slo, rate)
        mean, lo, hi = fs.interval(outcomes, rate)
        c = {"rate": rate, "live_mean": round(mean, 4), "lo": round(lo, 4), "hi": round(hi, 4),
             "live": [round(rate * sum(o) / max(1, len(o)), 4) for o in outcomes], "sim": round(sim_good, 4),
             "flagged": any(i["flagged"] for i in infos),
             "ttft_p50_ms": {"live": docs[0][0].get("median_ttft_ms"), "sim": sim_res.metrics.get("median_ttft_ms")},
             "tpot_p50_ms": {"live": docs[0][0].get("median_tpot_ms"), "sim": sim_res.metrics.get("median_tpot_ms")}}
        c |= fs.score_cell(sim_good, mean, lo, hi)
        live_phases = [i["phases_ms"] for i in infos if i.get("phases_ms")]
        if live_phases:  # where the time to first token went, as the live gateway counts it
            c["phases_ms"] = {"live": fs.mean_phases(live_phases), "sim": sim_run.phases_ms}
        c["live_vs_live"] = fs.leave_one_out(outcomes, rate)
        out["cells"][load] = c
    out["replay"] = store.score_replay(args.out_dir, modality, d, ctx, mc)
    for load, ph in out["replay"].pop("phases_ms", {}).items():
        if "phases_ms" in out["cells"].get(load, {}):
            out["cells"][load]["phases_ms"]["replay"] = ph
    return out


def summarize(per: dict, replay: dict) -> dict:
    """The last-line figures from {modality: {deployment: score_deployment(...)}}."""
    scored = [(m, n, load, c) for m, deps in per.items() for n, s in deps.items() for load, c in s["cells"].items()]
    normal = [c for _, _, load, c in scored if float(load) != OVERLOAD]
    lvl = [x for c in normal for x in c["live_vs_live"]]
    caps = {f"{m}/{n}": s["capacity_bias"] for m, deps in per.items() for n, s in deps.items()}
    agree = total = lvl_agree = lvl_total = 0
    for m, deps in per.items():
        for load in {load for s in deps.values() for load in s["cells"] if float(load) != OVERLOAD}:
            cells = {n: s["cells"][load] for n, s in deps.items() if load in s["cells"]}
            a, t = fs.rank_separable({n: {**c, "mean": c["live_mean"]} for n, c in cells.items()}, "sim")
            agree, total = agree + a, total + t
            for k in range(max((len(c["live"]) for c in cells.values()), default=0)):
                a, t = fs.rank_separable({n: {**c, "mean": c["live_mean"], "rep": c["live"][k]}
                                          for n, c in cells.items() if len(c["live"]) > k}, "rep")
                lvl_agree, lvl_total = lvl_agree + a, lvl_total + t
    coverage = round(sum(c["inside"] for c in normal) / len(normal), 4) if normal else None
    service = replay.get("service_time_err_median", {})
    phased = [c["phases_ms"] for c in normal if "phases_ms" in c]
    replay_err = replay.get("replay_ttft_p50_err_median")
    return {
        "capacity_bias_max": max((abs(v) for v in caps.values()), default=None), "capacity_bias": caps,
        "coverage": coverage, "bias_median": round(statistics.median(c["bias"] for c in normal), 4) if normal else None,
        "excess_median": fs.median_abs([c["excess"] for c in normal]),
        "service_time_err_median": service, "replay_ttft_p50_err_median": replay_err,
        "rank_agreement_separable": round(agree / total, 4) if total else None, "separable_pairs": total,
        "overload": {f"{m}/{n}": {"live": c["live_mean"], "sim": c["sim"], "bias": c["bias"]}
                     for m, n, load, c in scored if float(load) == OVERLOAD},
        "live_vs_live": {"coverage": round(sum(x["inside"] for x in lvl) / len(lvl), 4) if lvl else None,
                         "bias_median": round(statistics.median(x["bias"] for x in lvl), 4) if lvl else None,
                         "excess_median": fs.median_abs([x["excess"] for x in lvl]),
                         "rank_agreement_separable": round(lvl_agree / lvl_total, 4) if lvl_total else None,
                         "separable_pairs": lvl_total, "scored": len(lvl)},
        "phase_bias": fs.phase_bias([(p["sim"], p["live"]) for p in phased]),
        "replay_phase_bias": fs.phase_bias([(p["replay"], p["live"]) for p in phased if "replay" in p]),
        "miss_from": fs.attribute(service, replay_err, coverage),
        "flagged": sum(c["flagged"] for _, _, _, c in scored)}


def table(per: dict) -> str:
    head = "| modality | deployment | load | rate | live goodput mean [95 % interval] | repeats | sim | inside | bias |"
    lines = [head, "|" + " --- |" * 9]
    for m, deps in per.items():
        for n, s in deps.items():
            lines.append(f"| {m} | {n} | capacity | - | {s['live_capacity']:.3f} | 1 | {s['sim_capacity']:.3f} | - | "
                         f"{s['capacity_bias']:+.3f} |")
            for load, c in s["cells"].items():
                lines.append(f"| {m} | {n} | {load}x | {c['rate']:.3f} | {c['live_mean']:.3f} [{c['lo']:.3f}, "
                             f"{c['hi']:.3f}] | {', '.join(f'{x:.3f}' for x in c['live'])} | {c['sim']:.3f} | "
                             f"{'yes' if c['inside'] else 'no'} | {c['bias']:+.3f} |")
    return "\n".join(lines)


PHASE_ORDER = ("preprocess", "queue", "encode", "embed_transfer", "prefill", "ttft")


def phase_table(per: dict) -> str:
    """Per cell with live phases: each phase's mean ms live / simulated / replayed."""
    head = "| modality | deployment | load | " + " | ".join(PHASE_ORDER) + " |"
    lines = [head, "|" + " --- |" * (3 + len(PHASE_ORDER))]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for m, deps in per.items():
        for n, s in deps.items():
            for load, c in s["cells"].items():
                p = c.get("phases_ms")
                if p:
                    cols = [" / ".join(fmt(p.get(k, {}).get(ph)) for k in ("live", "sim", "replay"))
                            for ph in PHASE_ORDER]
                    lines.append(f"| {m} | {n} | {load}x | " + " | ".join(cols) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def prepare(args, modality: str) -> dict:
    model = checkpoint(None, args.cache_dir, FAMILIES[modality], args.scale)
    profile, path = profile_of(args, model, modality)
    spec = workload(args, profile, modality)
    return {"model": model, "profile": profile, "profile_path": str(path), "spec": spec, "modality": modality,
            "slo": profile.slo(args.slo), "host": host_work(args, modality, spec)}


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the running stack, like Ctrl-C
    t0 = time.monotonic()
    if args.resim:
        args.out_dir = Path(args.resim)
        state, ctxs = store.load_run(args)
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        ctxs = {m: prepare(args, m) for m in args.modalities}
        state = {m: {} for m in args.modalities}
        meta = {m: {"model": c["model"], "profile": c["profile_path"], "host": c["host"], "slo": c["slo"].to_dict(),
                    "deployments": list(args.by_modality[m])} for m, c in ctxs.items()}
        for k in range(args.repeats):
            for m in args.modalities:
                for name in args.by_modality[m]:
                    run_block(args, k, m, name, ctxs[m], state[m])
                    # after every block: a run cut short can still be scored (--resim)
                    (args.out_dir / "run.json").write_text(json.dumps(
                        {"args": vars(args) | {"out_dir": str(args.out_dir)}, "state": state, "meta": meta},
                        indent=1, default=str) + "\n")
    per = {m: {deployment(n).name: score_deployment(args, m, n, ctxs[m], state[m][deployment(n).name])
               for n in args.by_modality[m] if state[m].get(deployment(n).name, {}).get("cells")} for m in state}
    replay = store.summarize_replay({f"{m}/{n}": s.pop("replay") for m, deps in per.items() for n, s in deps.items()})
    text = table(per)
    if phases := phase_table(per):
        text += "\n\nPer-request phases, mean ms: live / simulated / replayed with the measured call times\n\n" + phases
    print(text)
    out = summarize(per, replay)
    out["minutes"] = round((time.monotonic() - t0) / 60, 2)
    (args.out_dir / "fidelity.md").write_text(text + "\n")
    (args.out_dir / "fidelity.json").write_text(json.dumps({"summary": out, "per": per, "replay": replay},
                                                           indent=1) + "\n")
    finish("sim_fidelity", args, out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
