"""The stored side of bench/sim_fidelity.py: a live cell's BenchConfig read back from its result
file, a finished run folder loaded for `--resim`, and the trace replay of its cells (service-time
error per stage and the replay with measured call times, bench/fidelity_replay.py)."""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from bench import fidelity_replay as fr
from hasctl.bench import BenchConfig
from hasctl.profile_host import media_label
from hasctl.workload import WorkloadSpec


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


def spans_to_json(spans: dict) -> dict:
    return {name: [dataclasses.asdict(s) for s in ss] for name, ss in spans.items()}


def spans_from_json(doc: dict) -> dict:
    return {name: [fr.Span(**s) for s in ss] for name, ss in doc.items()}


def load_run(args) -> tuple[dict, dict]:
    """(state, contexts) of the run folder args.out_dir, as bench/sim_fidelity.py left them."""
    from easerve.profile_format import load
    from easerve.slo import SLO
    doc = json.loads((args.out_dir / "run.json").read_text())
    ctxs = {}
    for m, meta in doc["meta"].items():
        profile = load(Path(meta["profile"]) if Path(meta["profile"]).is_file() else
                       args.out_dir / Path(meta["profile"]).name)
        s = meta["slo"]
        slo = SLO(s["ttft_ms"], s["tpot_ms"], tuple((k, v["ttft_ms"], v["tpot_ms"])
                                                     for k, v in s.get("by_modality", {}).items()), s.get("tier", ""))
        ctxs[m] = {"model": meta["model"], "profile": profile, "modality": m, "profile_path": meta["profile"], "slo": slo,
                   "host": meta["host"]}
    args.by_modality = {m: tuple(meta["deployments"]) for m, meta in doc["meta"].items()}
    return doc["state"], ctxs


def score_replay(out_dir: Path, modality: str, d, ctx: dict, mc) -> dict:
    """Over the cells of deployment `d` that kept their spans: per stage the median |log(pred /
    measured)| of its calls, and the replay of the live arrivals with the measured call times
    (its TTFT error, and its per-request phases by cell load: "phases_ms")."""
    from easerve.policy.service_model import ServiceModel
    from easerve.slo import RequestRecord
    from hasctl.simulate import run_simulation
    run_dir, profile = out_dir / modality / d.name, ctx["profile"]
    label = media_label(profile, modality)
    where = fr.placements(d)
    per_stage: dict[str, list[float]] = {}
    replays, phases = [], {}
    for sp in sorted(run_dir.glob("live-r0-*-spans.json")):
        spans = spans_from_json(json.loads(sp.read_text()))
        errs = fr.service_time_errors(spans, ServiceModel(profile, mc), where=where, media=(modality, label))
        for stage, e in errs.items():
            if e.count:
                per_stage.setdefault(stage, []).append(e.median)
        live_doc = json.loads((run_dir / sp.name.replace("-spans", "")).read_text())
        live = [RequestRecord.from_dict(r) for r in live_doc["records"]]
        mm = fr.MeasuredModel(profile, spans, mc, where=where, media=(modality, label))
        reqs = fr.replay_requests(live, mm, {modality: label})
        sim, run = run_simulation(d, profile, config_of(live_doc), mc, requests=reqs, service_model=mm)
        replays.append(fr.replay_ttft_error(live, sim.records)["replay_ttft_p50_err"])
        phases[sp.name.removeprefix("live-r0-").removesuffix("-spans.json")] = run.phases_ms
    return {"service_time_err": {s: round(statistics.median(v), 4) for s, v in per_stage.items()},
            "replay_ttft_p50_err": [round(x, 4) for x in replays if x is not None], "phases_ms": phases}


def summarize_replay(by_deployment: dict) -> dict:
    stages: dict[str, list[float]] = {}
    replays: list[float] = []
    for r in by_deployment.values():
        for s, v in r["service_time_err"].items():
            stages.setdefault(s, []).append(v)
        replays += r["replay_ttft_p50_err"]
    return {"service_time_err_median": {s: round(statistics.median(v), 4) for s, v in stages.items()},
            "replay_ttft_p50_err_median": round(statistics.median(replays), 4) if replays else None,
            "by_deployment": by_deployment}
