"""How far two `hasctl profile` runs of the same checkpoint on the same machine disagree: the noise
floor under any comparison of live call times against one profile.

bench/sim_fidelity.py scores the simulator's service times (each live call span against the
profile's prediction for it) with the median |log(predicted / measured)| per stage. A profile is
itself a measurement: this bench takes `--repeats` full profiles of the bench-scale checkpoint
back to back (`hasctl profile`, each in a process of its own, the load average and CPU steal
logged around each) and, for every point they share (encode per media size and batch, the
encode share grid, prefill per prompt length and batch, decode per batch and context, the
gateway per media size), the |log ratio| between each pair of profiles. Per stage: the median
over points and pairs (`pairwise_abs_log_median`) and the median over points of max / min across
the profiles (`spread_median`).

  python bench/profile_noise.py                 # bench scale, 3 profiles (about 17 min here)
  python bench/profile_noise.py --quick         # tiny checkpoint, 2 quick profiles
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import results  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.sim_fidelity import cpu_ticks, load_average, steal_share  # noqa: E402
from easerve.profile_format import Profile, load  # noqa: E402


def points(p: Profile) -> dict[tuple, float]:
    """Every timed point of a profile, keyed by (stage, what sets its size)."""
    out: dict[tuple, float] = {}
    for s in p.encode.by_size if p.encode else ():
        out[("encode", s.modality, s.media, s.batch_size)] = s.latency_s
    for g in p.encode.grid if p.encode else ():
        out[("encode_grid", g.batch_size, g.share)] = g.latency_s
    for q in p.prefill:
        out[("prefill", q.prompt_len, q.batch_size)] = q.latency_s
    for d in p.decode:
        out[("decode", d.batch_size, d.context_len)] = d.step_s
    for g in p.gateway:
        out[("gateway", g.modality, g.media)] = g.latency_s
    return out


def compare(profiles: list[dict[tuple, float]]) -> dict:
    """Per stage: the median |log ratio| over shared points and profile pairs, and the median
    over points of max / min across the profiles."""
    logs: dict[str, list[float]] = {}
    spreads: dict[str, list[float]] = {}
    shared = set.intersection(*(set(p) for p in profiles))
    for key in sorted(shared, key=str):
        vals = [p[key] for p in profiles]
        if min(vals) <= 0:
            continue
        logs.setdefault(key[0], []).extend(abs(math.log(a / b)) for a, b in itertools.combinations(vals, 2))
        spreads.setdefault(key[0], []).append(max(vals) / min(vals))
    return {"pairwise_abs_log_median": {k: round(statistics.median(v), 4) for k, v in logs.items()},
            "spread_median": {k: round(statistics.median(v), 3) for k, v in spreads.items()},
            "points": {k: len(v) for k, v in spreads.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="profiles taken back to back")
    ap.add_argument("--family", default="qwen2.5-vl")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the checkpoint is built")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "profile-noise"), help="where the profiles go")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint, 2 profiles with --quick")
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 2
    if args.repeats < 2:
        ap.error("--repeats must be >= 2: the noise is between profiles")
    t0 = time.monotonic()
    model = checkpoint(None, args.cache_dir, args.family, "tiny" if args.quick else "bench")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    taken, machine = [], []
    for k in range(args.repeats):
        path = out_dir / f"profile-{k}.json"
        load0, ticks = load_average(), cpu_ticks()
        cmd = [sys.executable, "-m", "hasctl.cli", "profile", "--model", model, "--out", str(path), "--no-progress"]
        subprocess.run(cmd + (["--quick", "--repeats", "3"] if args.quick else []), check=True, cwd=ROOT)
        machine.append({"load_average_before": load0, "steal": round(steal_share(ticks, cpu_ticks()), 4)})
        taken.append(points(load(path)))
        print(f"profile {k} done", file=sys.stderr, flush=True)
    result = {**compare(taken), "family": args.family, "scale": "tiny" if args.quick else "bench",
              "profiles": args.repeats, "machine": machine, "minutes": round((time.monotonic() - t0) / 60, 2)}
    results.finish("profile_noise", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
