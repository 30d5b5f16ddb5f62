"""The roofline model checked where we can measure: on this CPU, each bench-scale checkpoint's
roofline profile (easerve.roofline, the CPU's spec) vs its measured profile (`hasctl profile`),
point by point: every encode grid point (batch x share), encode by media size, prefill (prompt
length x batch) and decode step (batch x context).

The error of a point is |roofline - measured| / measured. Reported three ways:
- "median_rel_err": the spec file's stated efficiency factors (what `hasctl profile --roofline`
  writes; target <= 0.30);
- "median_rel_err_cv": factors fitted leaving one family out (fit on the other two, predict the
  third): how well a fit carries to a model it has not seen;
- "fitted": the factors fitted on every family (`--write-spec FILE` writes the spec with them).
The fit is a grid search over compute efficiency, per-layer and per-call overheads (memory
efficiency stays 1.0: the spec's bandwidth is itself a measurement) minimizing the median error.

  python bench/roofline_check.py --quick                         # hasctl profile --quick per checkpoint
  python bench/roofline_check.py --profile qwen2.5-vl=runs/prof-qwen.json ...   # reuse measured profiles
Last stdout line: JSON with "median_rel_err", "median_rel_err_cv", per-family and per-stage medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402

from easerve.roofline import DeviceSpec, load_arch, load_spec  # noqa: E402
from easerve import profile_format as pf  # noqa: E402
from hasctl.roofline_profile import RooflineModel  # noqa: E402

FAMILIES = ("llava-next", "qwen2.5-vl", "ultravox")
COMPUTE = (0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LAYER_S = (0.0, 2e-5, 5e-5, 1e-4, 2e-4, 4e-4, 8e-4)
CALL_S = (0.0, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2, 0.1)


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--profile", action="append", default=[], metavar="FAMILY=PATH",
                    help="a measured profile of FAMILY's bench-scale checkpoint to reuse instead of measuring")
    ap.add_argument("--spec", default="cpu-epyc-1c", help="device spec of this CPU (name or SPEC.json)")
    ap.add_argument("--cores", default="0", help="cores hasctl profile measures on (one torch thread per core); "
                    "default one core, as the cpu-epyc-1c spec was measured")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the bench-scale checkpoints are built")
    ap.add_argument("--out-dir", default=None, help="default: runs/roofline-check-<time>")
    ap.add_argument("--quick", action="store_true", help="measure with hasctl profile --quick (few small points)")
    ap.add_argument("--write-spec", default=None, help="write the spec with the fitted factors to this file")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    if bad := [f for f in args.families if f not in FAMILIES]:
        ap.error(f"--families: {bad} unknown; choose from {list(FAMILIES)}")
    try:
        args.profile = dict(x.split("=", 1) for x in args.profile)
    except ValueError:
        ap.error("--profile takes FAMILY=PATH")
    args.out_dir = Path(args.out_dir or ROOT / "runs" / time.strftime("roofline-check-%Y%m%d-%H%M%S"))
    return args


def measured_profile(args, family: str, model: str) -> pf.Profile:
    if family in args.profile:
        return pf.load(args.profile[family])
    out = args.out_dir / f"measured-{family}.json"
    cmd = [sys.executable, "-m", "hasctl.cli", "profile", "--model", model, "--out", str(out), "--no-progress",
           "--cores", args.cores]
    subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return pf.load(out)


def points(rm: RooflineModel, prof: pf.Profile) -> list[tuple[str, str, float, float]]:
    """(stage, point, measured s, roofline s) for every measured point."""
    out = []
    if prof.encode:
        e = prof.encode
        out += [("encode", f"b={p.batch_size} share={p.share:g}", p.latency_s,
                 rm.encode_s(e.reference_modality, e.reference_media, p.batch_size, p.share)) for p in e.grid]
        out += [("encode", f"{p.modality} {p.media} b={p.batch_size}", p.latency_s,
                 rm.encode_s(p.modality, p.media, p.batch_size)) for p in e.by_size]
    out += [("prefill", f"len={p.prompt_len} b={p.batch_size}", p.latency_s, rm.prefill_s(p.prompt_len, p.batch_size))
            for p in prof.prefill]
    out += [("decode", f"b={p.batch_size} ctx={p.context_len}", p.step_s, rm.decode_s(p.batch_size, p.context_len))
            for p in prof.decode]
    return out


def rel_errs(rows) -> list[float]:
    return [abs(r - m) / m for _, _, m, r in rows]


def with_factors(spec: DeviceSpec, c: float, lo: float, co: float) -> DeviceSpec:
    return dataclasses.replace(spec, efficiency=dataclasses.replace(spec.efficiency, compute=c, memory=1.0,
                                                                     layer_overhead_s=lo, call_overhead_s=co))


def fit(spec: DeviceSpec, cases: list[tuple], families: list[str]) -> tuple[DeviceSpec, float]:
    """The factors of the grid minimizing the median error over `families`' points."""
    best = None
    for c, lo, co in itertools.product(COMPUTE, LAYER_S, CALL_S):
        s = with_factors(spec, c, lo, co)
        errs = [e for fam, arch, prof in cases if fam in families for e in rel_errs(points(RooflineModel(arch, s), prof))]
        med = statistics.median(errs)
        if best is None or med < best[1]:
            best = (s, med)
    return best


def main(argv=None) -> int:
    args = args_of(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(args.spec)
    cases = []
    for fam in args.families:
        model = checkpoint(None, args.cache_dir, fam)
        cases.append((fam, load_arch(model), measured_profile(args, fam, model)))
    table, per_family, per_stage = [], {}, {}
    for fam, arch, prof in cases:
        for stage, point, m, r in points(RooflineModel(arch, spec), prof):
            err = abs(r - m) / m
            table.append(f"| {fam} | {stage} | {point} | {m * 1e3:.2f} | {r * 1e3:.2f} | {err:.2f} |")
            per_family.setdefault(fam, []).append(err)
            per_stage.setdefault(stage, []).append(err)
    cv = []
    if len(cases) > 1:
        for fam, arch, prof in cases:
            s, _ = fit(spec, cases, [f for f, _, _ in cases if f != fam])
            cv += rel_errs(points(RooflineModel(arch, s), prof))
    fitted, fitted_med = fit(spec, cases, [f for f, _, _ in cases])
    if args.write_spec:
        d = {k: v for k, v in dataclasses.asdict(fitted).items()}
        d["source"] += "; efficiency fitted by bench/roofline_check.py"
        Path(args.write_spec).write_text(json.dumps(d, indent=1) + "\n")
    all_errs = [e for v in per_family.values() for e in v]
    e = spec.efficiency
    lines = [f"# roofline vs measured on {spec.name} ({'quick' if all(p.quick for _, _, p in cases) else 'full'} profiles)", "",
             f"stated factors: compute {e.compute}, memory {e.memory}, layer {e.layer_overhead_s * 1e6:g} us, "
             f"call {e.call_overhead_s * 1e6:g} us", "",
             "| family | stage | point | measured ms | roofline ms | rel err |", "| --- | --- | --- | --- | --- | --- |",
             *table]
    (args.out_dir / "roofline_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fe = fitted.efficiency
    result = {"median_rel_err": round(statistics.median(all_errs), 3),
              "median_rel_err_cv": round(statistics.median(cv), 3) if cv else None,
              "median_rel_err_fitted": round(fitted_med, 3),
              "fitted": {"compute": fe.compute, "layer_overhead_s": fe.layer_overhead_s, "call_overhead_s": fe.call_overhead_s},
              "per_family": {k: round(statistics.median(v), 3) for k, v in per_family.items()},
              "per_stage": {k: round(statistics.median(v), 3) for k, v in per_stage.items()},
              "points": len(all_errs), "spec": spec.name, "quick": all(p.quick for _, _, p in cases)}
    (args.out_dir / "roofline_check.json").write_text(json.dumps(result, indent=1) + "\n")
    finish("roofline_check", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
