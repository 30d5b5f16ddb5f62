"""Does `hasctl tune --evaluator sim` pick, on this machine, a deployment whose live capacity is
within 5 % of the best live capacity among the deployments bench/sim_fidelity.py measured?

Reads a finished bench/sim_fidelity.py run folder (its profile, host-work file and each
deployment's live capacity, measured the same way), runs `hasctl tune --evaluator sim` (TPE,
--trials, with the host work) at the best measured live capacity as the rate on the run's
workload and SLO, then measures the picked deployment's live capacity with sim_fidelity's
protocol (the open loop at 2x the larger of its simulated and closed-loop throughput for
--capacity-s, completions per second in the steady window) and compares.

Last stdout line: JSON with "picked" (its deployment), "picked_live_capacity",
"best_live_capacity" (and which deployment), "picked_over_best", "within_5pct".

  python bench/sim_pick.py --run runs/sim-fidelity
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import sim_fidelity as sf  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=str(ROOT / "runs" / "sim-fidelity"), help="a finished sim_fidelity run folder")
    ap.add_argument("--modality", default="image")
    ap.add_argument("--trials", type=int, default=40, help="simulated TPE trials")
    ap.add_argument("--capacity-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    add_save_flag(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from hasctl.bench import run_bench
    from hasctl.deployment import Deployment
    from hasctl.launch import Stack
    from hasctl.trials import stop_uninterrupted
    args = parse_args(argv)
    run = Path(args.run)
    doc = json.loads((run / "run.json").read_text())
    meta, state = doc["meta"][args.modality], doc["state"][args.modality]
    caps = {n: s["live_capacity"] for n, s in state.items() if "live_capacity" in s}
    best_name = max(caps, key=caps.get)
    profile_path = meta["profile"]
    from easerve.profile_format import load
    profile = load(profile_path)
    spec = sf.workload(argparse.Namespace(output_tokens=doc["args"].get("output_tokens", 32)), profile, args.modality)
    host_file = run / "pick" / "host.json"
    host_file.parent.mkdir(parents=True, exist_ok=True)
    host_file.write_text(json.dumps(meta["host"]) + "\n")
    out = run / "pick" / "best.yaml"
    storage = run / "pick" / "tune.db"
    storage.unlink(missing_ok=True)
    size = f"{spec.image_size[0]}x{spec.image_size[1]}"
    cmd = [sys.executable, "-m", "hasctl.cli", "tune", "--evaluator", "sim", "--model", meta["model"],
           "--profile", profile_path, "--host-work", str(host_file), "--rate", f"{caps[best_name]:.4f}",
           "--trials", str(args.trials), "--storage", f"sqlite:///{storage}", "--study", "pick",
           "--seed", str(args.seed), "--modality", args.modality, "--image-size", size,
           "--audio-s", str(spec.audio_s), "--output-tokens", str(spec.output_tokens), "--ignore-eos",
           "--slo", doc["args"].get("slo", "moderate"), "--out", str(out), "--run-dir", str(run / "pick" / "trials")]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    d = Deployment.load(out)
    slo = profile.slo(doc["args"].get("slo", "moderate"))
    stack = Stack(d.with_model(meta["model"]).with_gateway_ports(0, 0), run_dir=run / "pick" / "stack",
                  env={"EASERVE_LOG_LEVEL": "WARNING"})
    try:
        stack.start(timeout=600)
        url = stack.endpoints.http
        asyncio.run(run_bench(sf.config(spec, slo, 4.0, 3, args.seed + 999, url)))
        ctx = {"host": meta["host"], "profile": profile, "modality": args.modality}
        mc = sf.model_config(sf.host_s_of(d, ctx), 0.0)
        how = argparse.Namespace(min_requests=150, seed=args.seed, capacity_s=args.capacity_s)
        picked = sf.live_capacity(url, d, profile, spec, slo, how, mc, run / "pick" / "capacity.json", stack)["capacity"]
    finally:
        stop_uninterrupted(stack)
    result = {"picked": d.to_dict(), "picked_live_capacity": round(picked, 4), "best": best_name,
              "best_live_capacity": round(caps[best_name], 4), "live_capacities": {k: round(v, 4) for k, v in caps.items()},
              "picked_over_best": round(picked / caps[best_name], 4),
              "within_5pct": picked >= 0.95 * caps[best_name]}
    finish("sim_pick", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
