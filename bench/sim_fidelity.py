"""How close the simulator (`hasctl simulate`, `easerve.sim`) comes to live runs on this machine.

Per modality, on its bench-scale checkpoint (`hasctl make-tiny --scale bench`): image on
Qwen2.5-VL, audio on Ultravox:

1. profile: `hasctl profile` of the checkpoint on this process's cores, reused when the run
   folder already holds it (`profile-<family>-<scale>.json`), or --profile FILE;
2. rates: each deployment's saturated throughput in the simulator (a burst of --requests sent at
   once), their median S; the rates are 0.5 S, S and 1.5 S (half of saturation, near it, over
   it), or --rates; the SLO is the profile's `--slo` tier;
3. cells: for each deployment (dynamo-like, default, colocated, monolith and
   bench/deployments/two-decode.yaml), one live stack (`hasctl.launch.Stack`, every worker on all
   cores, as the presets) warmed up with a few requests; its per-request overhead measured with
   --overhead-requests lone requests (`overhead`); then `hasctl bench` (`run_bench`, --requests
   Poisson arrivals, ignore_eos) at each rate, all rates --live-repeats times, each run with media
   of its own (`content_seed`: no cache hit from an earlier run); and `hasctl simulate`'s
   `run_simulation` on the first run's BenchConfig (same seed, arrival times, modalities, sizes)
   with the stack's overhead.

Prints the table (live / simulated: goodput, throughput, P50 / P99 TTFT and TPOT) and the
relative errors |sim - live| / live, where goodput and throughput take max(live, 0.2 req/s) as
the denominator (a cell near zero in both does not count as 100 % off). Saves (--out-dir) the
profiles, every cell's bench JSON (live and simulated, for `hasctl report`), fidelity.md and
fidelity.json. Last stdout line: JSON with "goodput_rel_err_median", "goodput_rel_err_max",
"ttft_p50_rel_err_median", "rank_agreement" (Kendall tau-b of the deployments' goodput order,
live vs simulated, per modality and rate, averaged), "live_vs_live" (the same figures for the
second live run of each cell against the first: the noise floor, `live_floor`) and "cells".

  python bench/sim_fidelity.py                           # image, 5 deployments x 3 rates, 60 requests, 2 live runs
  python bench/sim_fidelity.py --modalities image,audio  # adds Ultravox
  python bench/sim_fidelity.py --quick                   # tiny checkpoint, 2 deployments x 1 rate
  python bench/sim_fidelity.py --resim runs/sim-fidelity  # re-simulate a finished run's cells (seconds)

--resim DIR runs no live stack and measures nothing: it re-simulates every cell of a finished run
folder DIR (DIR/<modality>/<deployment>/live-<rate>.json, with DIR's profile) with the current
simulator on the very BenchConfig each live cell recorded (seed, rate, workload, SLO), rewrites
the sim-<rate>.json files, fidelity.md and fidelity.json there, and prints the same table and
last line. Copy the folder first to keep its earlier simulated files.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402

from hasctl.bench import BenchConfig, run_bench  # noqa: E402
from hasctl.deployment import Deployment, preset  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

FAMILIES = {"image": "qwen2.5-vl", "audio": "ultravox"}
DEPLOYMENTS = ("dynamo-like", "default", "colocated", "monolith", "bench/deployments/two-decode.yaml")
QUICK_DEPLOYMENTS = ("default", "monolith")
LOADS = (0.5, 1.0, 1.5)   # x the simulated saturation
CONTENT_SEED = 10_000    # + 100 x repeat + rate index: each live run's media (the warm-up's and overhead's differ too)
FLOOR_RPS = 0.2           # denominator floor of the goodput / throughput errors
FIELDS = (("request_goodput", "goodput"), ("request_throughput", "thru"), ("median_ttft_ms", "TTFT p50"),
          ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"))
RATE_FIELDS = ("request_goodput", "request_throughput")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default="image", help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--requests", type=int, default=60, help="requests per cell")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--slo", default="moderate", choices=["tight", "moderate", "loose"], help="profile SLO tier")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent to each stack before its cells")
    ap.add_argument("--overhead-requests", type=int, default=4,
                    help="requests sent one at a time to each idle stack after its warm-up: their median TTFT over "
                         "the simulator's for the same request is the stack's per-request overhead, which the "
                         "simulation of that deployment adds to every request (0: none)")
    ap.add_argument("--live-repeats", type=int, default=2,
                    help="live runs of each cell (same arrivals, new media, on the same stack, after all its rates): "
                         "the 2nd measures how far live runs of one cell differ from each other, the floor under "
                         "any simulator's error; the simulator is scored against the 1st")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the checkpoints are built")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "sim-fidelity"),
                    help="run folder (a profile found there is reused)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resim", default=None, metavar="DIR",
                    help="re-simulate the cells of the finished run folder DIR with the current simulator (no live run)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="simulate on this profile instead of measuring one (with --resim: instead of the run "
                         "folder's, e.g. one with a sharing curve); a live run also takes its SLO tier from it")
    ap.add_argument("--rates", default=None,
                    help="comma-separated req/s of the cells, one per load 0.5x, 1x, 1.5x (default: those loads x "
                         "the simulated saturation); e.g. an earlier run's rates, so its cells compare with these")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny checkpoint, `hasctl profile --quick`, default and monolith at S, 6 requests")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    args.modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    bad = [m for m in args.modalities if m not in FAMILIES]
    if bad:
        ap.error(f"--modalities: {bad} unknown; choose from {sorted(FAMILIES)}")
    args.scale, args.deployments, args.loads = "bench", DEPLOYMENTS, LOADS
    if args.quick:
        args.scale, args.deployments, args.loads = "tiny", QUICK_DEPLOYMENTS, (1.0,)
        args.requests, args.output_tokens, args.warmup, args.live_repeats, args.overhead_requests = 6, 8, 1, 1, 2
    args.out_dir = Path(args.out_dir)
    if args.rates is not None:
        args.rates = [float(x) for x in args.rates.split(",")]
        if len(args.rates) != len(args.loads) or min(args.rates) <= 0:
            ap.error(f"--rates: give {len(args.loads)} positive req/s, one per load {args.loads}")
    return args


def deployment(name: str) -> Deployment:
    return Deployment.load(ROOT / name) if name.endswith((".yaml", ".json")) else preset(name)


# ---- 1. checkpoint and profile ------------------------------------------------------------------
def profile_of(args, model: str, modality: str, say):
    """`hasctl profile` of `model` into the run folder, or the file an earlier run left there."""
    from easerve.profile_format import REVISION, load
    if args.profile:
        say(f"[{modality}] --profile {args.profile}")
        return load(args.profile), Path(args.profile)
    path = args.out_dir / f"profile-{FAMILIES[modality]}-{args.scale}{'-quick' if args.quick else ''}.json"
    if path.is_file():
        old = load(path)
        if old.revision >= REVISION:
            say(f"[{modality}] reusing {path}")
            return old, path
        path.rename(path.with_suffix(f".rev{old.revision}.json"))  # an older revision lacks what the simulator reads now
    say(f"[{modality}] hasctl profile {model} -> {path}")
    cmd = [sys.executable, "-m", "hasctl.cli", "profile", "--model", model, "--out", str(path), "--no-progress"]
    # --quick: the small plan, but the median of 3 calls per point (one call is at the mercy of a
    # neighbour's burst on these shared cores)
    subprocess.run(cmd + (["--quick", "--repeats", "3"] if args.quick else []), check=True, cwd=ROOT)
    return load(path), path


def workload(args, profile, modality: str) -> WorkloadSpec:
    """The profile's reference media size (its by_size points cover it) and output length."""
    enc = profile.encode
    size = next((p.media for p in enc.by_size if p.modality == modality), None) if enc else None
    if modality == "image":
        w, h = (int(x) for x in (size or "224x224").split("x"))
        return WorkloadSpec(modality="image", image_size=(w, h), output_tokens=args.output_tokens)
    return WorkloadSpec(modality="audio", audio_s=float((size or "2s").rstrip("s")), output_tokens=args.output_tokens)


def bench_config(args, spec: WorkloadSpec, slo, rate: float, label: str, url: str = "http://simulated.invalid",
                 content_seed: int | None = None):
    """A cell's BenchConfig; every live run on one stack gets a `content_seed` of its own (new media
    at the same arrivals), or the encoder and prefix caches would serve it the media of the cells
    before it, which no simulated cell (a fresh run) sees."""
    return BenchConfig(url=url, rate=rate, num_requests=args.requests, seed=args.seed, workload=spec,
                       ignore_eos=True, slo=slo, label=label, progress=False, content_seed=content_seed)


# ---- 2. rates -----------------------------------------------------------------------------------
def saturation(args, profile, spec: WorkloadSpec, slo) -> tuple[float, dict[str, float]]:
    """Median over the deployments of the simulated throughput of a burst of --requests."""
    from hasctl.simulate import run_simulation
    per = {}
    for name in args.deployments:
        d = deployment(name)
        per[d.name] = run_simulation(d, profile, bench_config(args, spec, slo, 1000.0, d.name))[0] \
            .metrics["request_throughput"]
    return statistics.median(per.values()), per


# ---- 3. cells -----------------------------------------------------------------------------------
def live_cells(args, d: Deployment, model: str, profile, spec: WorkloadSpec, slo, rates: list[float],
               run_dir: Path, say) -> dict[float, list[dict]]:
    """One stack for every rate of `d`: warm-up, then `hasctl bench` at each rate, the rates
    --live-repeats times over; {rate: [metrics of each repeat]}."""
    from hasctl.launch import Stack
    from hasctl.trials import stop_uninterrupted
    stack = Stack(d.with_model(model).with_gateway_ports(0, 0), run_dir=run_dir, env={"EASERVE_LOG_LEVEL": "WARNING"})
    out = {}
    try:
        stack.start(timeout=600)
        url = stack.endpoints.http
        if args.warmup:
            warm = BenchConfig(url=url, rate=4.0, num_requests=args.warmup, seed=args.seed + 999, workload=spec,
                               progress=False)
            asyncio.run(run_bench(warm))
        if args.overhead_requests:
            overhead(args, d, profile, spec, slo, url, run_dir, say)
        for k in range(max(1, args.live_repeats)):
            for j, rate in enumerate(rates):
                fresh = CONTENT_SEED + 100 * k + j
                result = asyncio.run(run_bench(bench_config(args, spec, slo, rate, d.name, url, content_seed=fresh)))
                (run_dir / (f"live-{rate:g}.json" if k == 0 else f"repeat{k}-{rate:g}.json")).write_text(result.to_json())
                out.setdefault(rate, []).append(result.metrics)
                say(f"  live{k or ''} {d.name:12s} {rate:6.3f} req/s: {brief(result.metrics)}")
    finally:
        stop_uninterrupted(stack)
    return out


def overhead(args, d: Deployment, profile, spec: WorkloadSpec, slo, url: str, run_dir: Path, say) -> None:
    """The stack's per-request overhead: --overhead-requests requests one at a time on the idle
    stack; their median TTFT over the simulator's TTFT of the same lone request, into
    run_dir/overhead.json (`model_config` reads it)."""
    from hasctl.simulate import run_simulation
    live = []
    for k in range(args.overhead_requests):
        one = BenchConfig(url=url, rate=1.0, num_requests=1, seed=args.seed + 500 + k, workload=spec,
                          ignore_eos=True, slo=slo, progress=False)
        m = asyncio.run(run_bench(one)).metrics
        if m.get("median_ttft_ms") is not None:
            live.append(m["median_ttft_ms"])
    if not live:
        say(f"  {d.name}: no overhead request completed; simulating without an overhead")
        return
    alone = BenchConfig(url="http://simulated.invalid", rate=1.0, num_requests=1, seed=args.seed + 500,
                        workload=spec, ignore_eos=True, slo=slo, progress=False)
    sim_ms = run_simulation(d, profile, alone)[0].metrics["median_ttft_ms"]
    doc = {"live_unloaded_ttft_ms": statistics.median(live), "live_samples_ms": live, "sim_unloaded_ttft_ms": sim_ms,
           "overhead_ms": max(0.0, statistics.median(live) - sim_ms)}
    (run_dir / "overhead.json").write_text(json.dumps(doc, indent=1) + "\n")
    say(f"  {d.name}: unloaded TTFT live {doc['live_unloaded_ttft_ms']:.0f} ms, simulated {sim_ms:.0f} ms: "
        f"overhead {doc['overhead_ms']:.0f} ms per request")


def model_config(run_dir: Path):
    """The simulator's ModelConfig for a deployment's cells: its measured overhead, if any."""
    from easerve.policy.service_model import ModelConfig
    path = run_dir / "overhead.json"
    ms = json.loads(path.read_text())["overhead_ms"] if path.is_file() else 0.0
    return ModelConfig(request_overhead_s=ms / 1e3)


def sim_cell(d: Deployment, profile, config: BenchConfig, run_dir: Path) -> dict:
    from hasctl.simulate import ENDPOINT, run_simulation
    bench, sim = run_simulation(d, profile, config, model_config(run_dir))
    doc = bench.to_dict()
    doc["endpoint"] = ENDPOINT
    doc["simulated"] = {"sim_seconds": sim.sim_seconds, "wall_seconds": sim.wall_seconds, "events": sim.events}
    (run_dir / f"sim-{config.rate:g}.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return bench.metrics


def cell(load: float, live: dict, sim: dict, repeat: dict | None = None) -> dict:
    """`repeat`: a second live run of the cell; its error against the first is the noise floor."""
    keep = lambda m: {k: m.get(k) for k, _ in FIELDS} | {"completed": m.get("completed"),  # noqa: E731
                                                        "failed": m.get("failed")}
    out = {"load": load, "live": keep(live), "sim": keep(sim), "err": cell_errors(live, sim)}
    if repeat is not None:
        out |= {"repeat": keep(repeat), "repeat_err": cell_errors(live, repeat)}
    return out


def brief(m: dict) -> str:
    return " ".join(f"{short}={fmt(m.get(k))}" for k, short in FIELDS) + f" failed={m.get('failed')}"


def fmt(v, p: int = 2) -> str:
    return "-" if v is None else f"{v:.{p}f}"


# ---- errors and ranks -----------------------------------------------------------------------
def rel_err(live: float | None, sim: float | None, floor: float = 0.0) -> float | None:
    """|sim - live| / max(live, floor); None where either is missing or the denominator is 0."""
    if live is None or sim is None:
        return None
    den = max(live, floor)
    return abs(sim - live) / den if den > 0 else None


def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b of two paired samples (ties in either counted as neither concordant nor
    discordant); None when one of them is all ties."""
    conc = disc = tx = ty = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    den = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / den if den > 0 else None


def cell_errors(live: dict, sim: dict) -> dict:
    return {k: rel_err(live.get(k), sim.get(k), FLOOR_RPS if k in RATE_FIELDS else 0.0) for k, _ in FIELDS}


def rank_taus(cells: dict, other: str) -> list[float | None]:
    """Kendall tau of the deployments' goodput order, live vs `other` ("sim" or "repeat"), per modality and rate."""
    taus = []
    for by_rate in cells.values():
        for by_dep in by_rate.values():
            names = sorted(n for n in by_dep if other in by_dep[n])
            if len(names) > 1:
                taus.append(kendall_tau([by_dep[n]["live"]["request_goodput"] or 0.0 for n in names],
                                        [by_dep[n][other]["request_goodput"] or 0.0 for n in names]))
    return taus


def live_floor(cells: dict) -> dict | None:
    """The same figures for the 2nd live run against the 1st: how far one live run is from another
    of the same cell. A deterministic simulator is at least half of that cell's gap from one of
    the two runs, so where this is above a target, no simulator reaches it against a single run."""
    flat = [{"err": c["repeat_err"]} for by_rate in cells.values() for by_dep in by_rate.values()
            for c in by_dep.values() if "repeat_err" in c]
    if not flat:
        return None
    known = [t for t in rank_taus(cells, "repeat") if t is not None]
    return {**error_figures(flat), "rank_agreement": _r(statistics.mean(known)) if known else None, "cells": len(flat)}


def summarize(cells: dict) -> dict:
    """The last-line figures from the cells {modality: {rate: {deployment: {live, sim, err}}}}."""
    flat = [c for by_rate in cells.values() for by_dep in by_rate.values() for c in by_dep.values()]
    taus = rank_taus(cells, "sim")
    known = [t for t in taus if t is not None]
    return {**error_figures(flat), "rank_agreement": _r(statistics.mean(known)) if known else None,
            "rank_rates": len(taus), "rank_rates_all_tied": len(taus) - len(known), "live_vs_live": live_floor(cells),
            "by_deployment": {name: error_figures([c for by_rate in cells.values() for by_dep in by_rate.values()
                                                   for n, c in by_dep.items() if n == name])
                              for name in dict.fromkeys(n for by_rate in cells.values() for by_dep in by_rate.values()
                                                        for n in by_dep)}}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def error_figures(cells: list[dict]) -> dict:
    """Median and max goodput error and median TTFT P50 error over `cells`."""
    good = [c["err"]["request_goodput"] for c in cells if c["err"]["request_goodput"] is not None]
    ttft = [c["err"]["median_ttft_ms"] for c in cells if c["err"]["median_ttft_ms"] is not None]
    return {"goodput_rel_err_median": _r(statistics.median(good)) if good else None,
            "goodput_rel_err_max": _r(max(good)) if good else None,
            "ttft_p50_rel_err_median": _r(statistics.median(ttft)) if ttft else None}


def table(cells: dict, meta: dict) -> str:
    repeats = any("repeat" in c for by_rate in cells.values() for by_dep in by_rate.values() for c in by_dep.values())
    head = ["modality", "deployment", "load", "rate"] + [f"{short} live/sim (err)" for _, short in FIELDS] + \
        (["goodput live 2nd run (err)", "TTFT p50 live 2nd run (err)"] if repeats else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for mod, by_rate in cells.items():
        for rate, by_dep in by_rate.items():
            for name, c in by_dep.items():
                vals = []
                for k, _ in FIELDS:
                    p = 2 if k in RATE_FIELDS else 0
                    e = c["err"][k]
                    vals.append(f"{fmt(c['live'].get(k), p)} / {fmt(c['sim'].get(k), p)} "
                                f"({'-' if e is None else f'{e:.0%}'})")
                for k in ("request_goodput", "median_ttft_ms") if repeats else ():
                    e = c.get("repeat_err", {}).get(k)
                    vals.append("-" if "repeat" not in c else
                                f"{fmt(c['repeat'].get(k), 2 if k in RATE_FIELDS else 0)} ({'-' if e is None else f'{e:.0%}'})")
                lines.append(f"| {mod} | {name} | {c['load']:g}x | {rate:g} | " + " | ".join(vals) + " |")
    for mod, m in meta.items():
        lines.append(f"\n{mod}: {m['family']} ({m['scale']}), profile {m['profile']}; simulated saturation "
                     f"{m['saturation_rps']:.3f} req/s (median of {m['saturation_by_deployment']}); SLO {m['slo']}; "
                     f"{m['requests']} requests per cell, Poisson, seed {m['seed']}, {m['output_tokens']} output "
                     f"tokens (ignore_eos); errors |sim - live| / live, goodput and throughput over "
                     f"max(live, {FLOOR_RPS} req/s).")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------
def run_modality(args, modality: str, say) -> tuple[dict, dict]:
    model = checkpoint(None, args.cache_dir, FAMILIES[modality], args.scale)
    profile, path = profile_of(args, model, modality, say)
    spec = workload(args, profile, modality)
    slo = profile.slo(args.slo)
    sat, per = saturation(args, profile, spec, slo)
    rates = args.rates or [round(f * sat, 3) for f in args.loads]
    say(f"[{modality}] simulated saturation {sat:.3f} req/s {per}; rates {rates}; SLO {slo.ttft_ms:.0f} ms TTFT, "
        f"{slo.tpot_ms:.1f} ms TPOT ({args.slo})")
    cells: dict[float, dict] = {r: {} for r in rates}
    for name in args.deployments:
        d = deployment(name)
        run_dir = args.out_dir / modality / d.name
        run_dir.mkdir(parents=True, exist_ok=True)
        live = live_cells(args, d, model, profile, spec, slo, rates, run_dir, say)
        for load, rate in zip(args.loads, rates):
            sim = sim_cell(d, profile, bench_config(args, spec, slo, rate, d.name), run_dir)
            say(f"  sim  {d.name:12s} {rate:6.3f} req/s: {brief(sim)}")
            cells[rate][d.name] = cell(load, live[rate][0], sim, live[rate][1] if len(live[rate]) > 1 else None)
    meta = {"family": FAMILIES[modality], "scale": args.scale, "model": model, "profile": str(path),
            "saturation_rps": sat, "saturation_by_deployment": {k: round(v, 3) for k, v in per.items()},
            "rates": rates, "slo": slo.to_dict(), "requests": args.requests, "seed": args.seed,
            "output_tokens": args.output_tokens}
    return cells, meta


# ---- --resim: the simulated side of a finished run ------------------------------------------------
def known_deployments() -> dict[str, Deployment]:
    return {d.name: d for d in map(deployment, dict.fromkeys(DEPLOYMENTS + QUICK_DEPLOYMENTS))}


def config_of(doc: dict) -> BenchConfig:
    """The BenchConfig a live cell recorded, aimed at no server (the simulator's)."""
    from easerve.slo import SLO
    c = dict(doc["config"])
    w = {k: tuple(v) if isinstance(v, list) else v for k, v in c.pop("workload").items()}
    s = c.pop("slo")
    slo = None if s is None else SLO(s["ttft_ms"], s["tpot_ms"], tuple(
        (m, v["ttft_ms"], v["tpot_ms"]) for m, v in s.get("by_modality", {}).items()), s.get("tier", ""))
    c.update(url="http://simulated.invalid", workload=WorkloadSpec(**w), slo=slo, progress=False)
    return BenchConfig(**c)


def resim_modality(folder: Path, modality: str, old: dict, say, profile_file: str | None = None) -> tuple[dict, dict]:
    """Every live cell of `folder`/`modality` against the simulator now; `old`: the folder's
    fidelity.json (its cells' loads and meta), {} when it has none."""
    from easerve.profile_format import load
    meta = dict(old.get("meta", {}).get(modality, {}))
    named = Path(meta["profile"]).name if meta.get("profile") else None
    paths = [Path(profile_file)] if profile_file else [folder / named] if named and (folder / named).is_file() else \
        sorted(folder.glob(f"profile-{FAMILIES[modality]}-*.json"))
    if not paths:
        raise SystemExit(f"--resim: no profile-{FAMILIES[modality]}-*.json in {folder}")
    profile = load(paths[0])
    loads = {k: c["load"] for k, c in old.get("summary", {}).get("cells", {}).items()}
    deps, cells = known_deployments(), {}
    for run_dir in sorted(p for p in (folder / modality).iterdir() if p.is_dir()):
        d = deps.get(run_dir.name)
        if d is None:
            raise SystemExit(f"--resim: {run_dir} is no deployment this bench runs ({sorted(deps)})")
        lives = sorted(run_dir.glob("live-*.json"), key=lambda p: float(p.stem[5:]))
        for i, path in enumerate(lives):
            doc = json.loads(path.read_text())
            config = config_of(doc)
            sim = sim_cell(d, profile, config, run_dir)
            say(f"  sim  {d.name:12s} {config.rate:6.3f} req/s: {brief(sim)}")
            load_ = loads.get(f"{modality}/{d.name}@{config.rate:g}", LOADS[i] if len(lives) == len(LOADS) else 0.0)
            again = run_dir / f"repeat1-{config.rate:g}.json"
            repeat = json.loads(again.read_text()) if again.is_file() else None
            cells.setdefault(config.rate, {})[d.name] = cell(load_, doc, sim, repeat)
    meta.update(profile=str(paths[0]), resimulated=True)
    meta.setdefault("saturation_rps", float("nan"))
    for k, v in (("family", FAMILIES[modality]), ("scale", "?"), ("saturation_by_deployment", {}), ("slo", {}),
                 ("requests", "?"), ("seed", "?"), ("output_tokens", "?")):
        meta.setdefault(k, v)
    return dict(sorted(cells.items())), meta


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.resim:
        args.out_dir = Path(args.resim)
        mods = [m for m in FAMILIES if (args.out_dir / m).is_dir()]
        if not mods:
            raise SystemExit(f"--resim: {args.out_dir} holds no {'/ '.join(FAMILIES)} folder of a sim_fidelity run")
        args.modalities = mods
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the running stack, like Ctrl-C
    t0 = time.monotonic()
    cells, meta = {}, {}
    old = json.loads((args.out_dir / "fidelity.json").read_text()) if args.resim and \
        (args.out_dir / "fidelity.json").is_file() else {}
    for m in args.modalities:
        cells[m], meta[m] = resim_modality(args.out_dir, m, old, say, args.profile) if args.resim else run_modality(args, m, say)
    text = table(cells, meta)
    print(text)
    (args.out_dir / "fidelity.md").write_text(text + "\n")
    out = summarize(cells)
    out["minutes"] = round((time.monotonic() - t0) / 60, 2)
    out["cells"] = {f"{mod}/{name}@{rate:g}": c for mod, by_rate in cells.items()
                    for rate, by_dep in by_rate.items() for name, c in by_dep.items()}
    (args.out_dir / "fidelity.json").write_text(json.dumps({"summary": out, "meta": meta}, indent=2) + "\n")
    say(f"saved {args.out_dir / 'fidelity.md'} and fidelity.json")
    finish("sim_fidelity", args, out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
