"""How much the simulated paper ratios (bench/paper_setting.py) depend on the workload details the
paper summary leaves open (issue 20, part 3): the media size (image pixels, video frames, audio
seconds), the prompt length, the output length and the SLO tier. One knob at a time around
paper_setting's choices (WORKLOAD: image 672x672, video 16 x 448x448, audio 10 s, 32 text tokens,
128 output tokens; the moderate tier), on the same machine (8 x RTX 6000 Ada, tp 2 groups,
roofline profiles) and the same three systems in the simulator:

- vLLM-like: one monolith per tensor-parallel group, encoding as vLLM's engine does
  (bench/paper_setting.py, `vllm_like`);
- dynamo-like: request-at-a-time encode, every prefill remote, its best E/P/D allocation;
- EAServe: `hasctl tune --evaluator sim` (moderate tier of the variant) at the first ladder rate
  at or above the best baseline goodput (full mode), or, with
  --quick, the best of the points HAS tries first (hasctl.tune_space.warm_starts: the vLLM-like
  data-parallel monolith, the Dynamo-like layout on the first E/P/D split, then remote prefill,
  co-located prefill and the monolith, each adaptive at B = 8) with no TPE draws; so EAServe
  is never below vLLM-like here, and a ratio of 1.0 over it means nothing beat the monolith.

Each system's goodput is its best over the rate ladder of rate x SLO attainment (as paper_setting).
The SLO of a variant is its tier's multiple (2x / 4x / 8x) of that variant's own unloaded TTFT and
TPOT (roofline encode of one item + prefill of its prompt; one decode step at that context), so a
larger image is allowed a longer TTFT, as a profile of that workload would set it. The SLO-tier
knob re-scores the same simulated runs.

`--encode-overhead-s X` builds the profiles with the stacks' fixed cost per encode call
(bench/paper_setting.py fits it; default 0: the roofline alone).

  python bench/paper_sensitivity.py --quick     # 3 modalities x 4 workloads x 3 tiers, warm starts only
Last stdout line: JSON with "ratios" (per modality, per variant: easerve_over_vllm and
easerve_over_dynamo), "spread" (per modality and ratio: min and max over the variants) and
"base" (the paper_setting choices' ratios).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.harness.results import add_save_flag, finish  # noqa: E402

from paper_setting import MODELS, WORKLOAD, cell_requests, machine_args, tune, vllm_like, overhead_seconds, with_encode_overhead  # noqa: E402

from easerve.roofline import load_arch, load_spec  # noqa: E402
from easerve import profile_format as pf  # noqa: E402
from hasctl.bench import BenchConfig  # noqa: E402
from easerve.slo import SLO, compute_metrics  # noqa: E402
from hasctl.roofline_profile import TEXT_TOKENS, RooflineModel, build  # noqa: E402
from hasctl.simulate import PROFILE_TEXT_TOKENS, media_of, run_simulation  # noqa: E402
from hasctl.tune_space import Space, deployment_for, runnable_allocations, warm_starts  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

# the alternatives to WORKLOAD's choice, --quick taking the first: media sizes the roofline profile has
# points for (ROOFLINE_PLAN); 32 video frames (4,096 rows + text) exceed the simulated decode's model
# length (easerve.engine.config.DEFAULT_MAX_MODEL_LEN, 4,096), so every such request fails (400)
MEDIA = {"image": ("image_size", [(1024, 768), (336, 336)]), "video": ("video_frames", [8, 32]),
         "audio": ("audio_s", [30.0, 5.0])}
PROMPTS, OUTPUTS = [1024, 256], [512, 32]
TIERS = pf.DEFAULT_MULTIPLIERS


def args_of(argv=None):
    ap = machine_args(__doc__)
    ap.add_argument("--trials", type=int, default=30, help="TPE trials per variant (full mode)")
    ap.add_argument("--requests", type=int, default=200, help="requests per simulated cell, at least")
    ap.add_argument("--min-duration-s", type=float, default=60.0,
                    help="each cell's arrivals last at least this long (as bench/paper_setting.py)")
    ap.add_argument("--rates", default="0.25,0.5,1,1.5,2,3,4,6,8,12,16,24,32,48")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--encode-overhead-s", type=overhead_seconds, default=0.0,
                    help="the stacks' fixed cost per encode call, seconds (bench/paper_setting.py fits it)")
    ap.add_argument("--quick", action="store_true",
                    help="one alternative per knob, 30 requests, 5 rates, EAServe from the warm starts only")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rates, args.min_duration_s = 30, "2,4,8,16,32", 20.0
    args.modalities = [m for m in args.modalities.split(",") if m]
    args.rates = [float(x) for x in args.rates.split(",")]
    args.out_dir = Path(args.out_dir or ROOT / "runs" / time.strftime("paper-sensitivity-%Y%m%d-%H%M%S"))
    return args


def variants(m: str, quick: bool) -> list[tuple[str, dict]]:
    """(name, WorkloadSpec overrides): the base, then one knob at a time."""
    key, sizes = MEDIA[m]
    pick = (lambda xs: xs[:1]) if quick else (lambda xs: xs)
    out = [("base", {})]
    out += [(f"{key}={'x'.join(map(str, v)) if isinstance(v, tuple) else f'{v:g}'}", {key: v}) for v in pick(sizes)]
    out += [(f"input_tokens={n}", {"input_tokens": n}) for n in pick(PROMPTS)]
    out += [(f"output_tokens={n}", {"output_tokens": n}) for n in pick(OUTPUTS)]
    return out


def slos(rm: RooflineModel, spec: WorkloadSpec) -> dict[str, SLO]:
    """Each tier's SLO of this workload: multiples of its own unloaded TTFT / TPOT."""
    m = spec.modality
    media = media_of(spec, m)
    n = spec.input_tokens + (TEXT_TOKENS - PROFILE_TEXT_TOKENS) + rm.arch.rows(m, media)
    ttft, tpot = rm.encode_s(m, media, 1) + rm.prefill_s(n, 1), rm.decode_s(1, n)
    return {t: SLO(ttft * 1e3 * k, tpot * 1e3 * k, tier=t) for t, k in TIERS.items()}


def best(deployments, prof, spec: WorkloadSpec, tiers: dict[str, SLO], args) -> dict[str, float]:
    """Per tier: the best over deployments and rates of rate x SLO attainment."""
    out = dict.fromkeys(tiers, 0.0)
    for d in deployments:
        for rate in args.rates:
            cfg = BenchConfig(url="http://simulated.invalid", rate=rate, num_requests=cell_requests(args, rate), seed=0,
                              workload=spec, ignore_eos=True, slo=None, progress=False)
            bench, _ = run_simulation(d, prof, cfg)
            for t, slo in tiers.items():
                att = compute_metrics(bench.records, slo)
                out[t] = max(out[t], rate * float(att.get("slo_attainment") or 0.0))
    return out


def main(argv=None) -> int:
    args = args_of(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dev = with_encode_overhead(load_spec(args.gpu), args.encode_overhead_s)
    devices = [f"cuda:{i * args.tp}" for i in range(args.gpus // args.tp)]
    ratios: dict = {}
    lines = ["| modality | variant | tier | vLLM-like | dynamo-like | EAServe | / vLLM | / dynamo |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in args.modalities:
        model = str(ROOT / "bench" / "paper_models" / MODELS[m])
        prof = build(model, dev, args.tp)
        prof_path = pf.dump(prof, args.out_dir / f"roofline-{m}.json")
        rm = RooflineModel(load_arch(model), dev, args.tp)
        space = Space(tuple(runnable_allocations(len(devices))), tuple(devices), tp=args.tp)
        dyn_space = dataclasses.replace(space, allocations=tuple(a for a in space.allocations if not a.colocated),
                                        batch_sizes=(1,), monolith=False, batch_modes=("request_at_a_time",))
        dynamo = [deployment_for(dyn_space, {"alloc": a.name, "mode": "request_at_a_time"}, model, "dynamo-like")
                  for a in dyn_space.allocations]
        for name, over in variants(m, args.quick):
            spec = WorkloadSpec(modality=m, **{**WORKLOAD, **over})
            tiers = slos(rm, spec)
            g = {"vllm": best([vllm_like(model, devices, prof, spec, args.tp)], prof, spec, tiers, args),
                 "dynamo": best(dynamo, prof, spec, tiers, args)}
            if args.quick:
                ours = [deployment_for(space, p, model, "easerve") for p in warm_starts(space)]
            else:
                top = max(g["vllm"]["moderate"], g["dynamo"]["moderate"])  # tune where the baselines saturate
                rate = min([r for r in args.rates if r >= top] or args.rates[-1:])
                mod = tiers["moderate"]
                ours = [tune(args, m, model, prof_path, devices, rate, {**WORKLOAD, **over}, f"{m}-{name}",
                             (mod.ttft_ms, mod.tpot_ms))]
            g["easerve"] = best(ours, prof, spec, tiers, args)
            for t in tiers:
                r = {k: round(g["easerve"][t] / g[k][t], 3) if g[k][t] > 0 else None for k in ("vllm", "dynamo")}
                ratios.setdefault(m, {})[f"{name}/{t}"] = {"easerve_over_vllm": r["vllm"],
                                                            "easerve_over_dynamo": r["dynamo"]}
                lines.append(f"| {m} | {name} | {t} | {g['vllm'][t]:.2f} | {g['dynamo'][t]:.2f} | "
                             f"{g['easerve'][t]:.2f} | {r['vllm']} | {r['dynamo']} |")
    spread = {m: {k: [min(vals), max(vals)] if (vals := [v[k] for v in per.values() if v[k] is not None]) else None
                  for k in ("easerve_over_vllm", "easerve_over_dynamo")} for m, per in ratios.items()}
    result = {"spread": spread, "base": {m: per.get("base/moderate") for m, per in ratios.items()},
              "ratios": ratios, "encode_call_overhead_s": args.encode_overhead_s, "quick": args.quick}
    title = (f"# Sensitivity of the simulated paper ratios ({args.gpus} x {dev.name}, tp {args.tp}"
             f"{', quick: EAServe = warm starts only' if args.quick else ''})")
    text = "\n".join([title, "", *lines])
    (args.out_dir / "paper_sensitivity.md").write_text(text + "\n")
    (args.out_dir / "paper_sensitivity.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    finish("paper_sensitivity", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
