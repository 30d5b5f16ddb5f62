"""The paper's secondary figures (issue 20, part 3), simulated beside the paper's own numbers, on
bench/paper_setting.py's machine (8 x RTX 6000 Ada as tp 2 groups, roofline profiles, its WORKLOAD):

1. fixed encode batch of 8 vs request-at-a-time on LLaVA-v1.6-34B (paper: throughput 0.75 -> 1.09
   req/s, mean TTFT 367.4 -> 112.1 s, mean TPOT 179 -> 411 ms), the same E1-P1-D2 allocation, at
   --overload x the request-at-a-time deployment's saturated throughput (the paper's TTFTs of
   minutes are an overloaded run's);
2. the burstiest arrivals at the same mean rate (gamma, shape --burstiness) vs Poisson on the
   EAServe default deployment (remote prefill, adaptive B = 8) on LLaVA-v1.6-34B, at 0.9 x its
   saturated throughput (paper: ~ -3 % throughput, P99 TTFT 10.2 -> 16.5 s);
3. dynamic SM partitioning vs time-slicing of a co-located encode + prefill at 10 req/s on
   Ultravox-27B (E2-P1-D1, encode co-locating prefill, s = 0.5; paper: +9 % throughput, -16 % P99 TTFT,
   -29 % P99 TPOT).

`--encode-overhead-s X` builds the profiles with the stacks' fixed cost per encode call that
bench/paper_setting.py fits to the paper's table (default 0: the roofline alone), so these
figures, which the fit never saw, check it.

Saturated throughput: the request throughput of a burst (every request at t = 0 spread over a
second). Last stdout line: JSON with each check's ours and the paper's figures ("fixed8", "bursty",
"partition"), and the ratios (ours, paper) side by side.

  python bench/paper_secondary.py --quick        # 60 requests per run instead of 300
  python bench/paper_secondary.py --encode-overhead-s 0.4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.harness.results import add_save_flag, finish  # noqa: E402

from paper_setting import MODELS, WORKLOAD, overhead_seconds, with_encode_overhead  # noqa: E402

from easerve.roofline import load_spec  # noqa: E402
from hasctl.bench import BenchConfig  # noqa: E402
from hasctl.deployment import Deployment, Worker  # noqa: E402
from hasctl.roofline_profile import build  # noqa: E402
from hasctl.simulate import run_simulation  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

PAPER = {"fixed8": {"throughput": (0.75, 1.09), "mean_ttft_s": (367.4, 112.1), "mean_tpot_ms": (179, 411)},
         "bursty": {"throughput_change": -0.03, "p99_ttft_s": (10.2, 16.5)},
         "partition": {"throughput_change": 0.09, "p99_ttft_change": -0.16, "p99_tpot_change": -0.29}}
KEYS = ("request_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="rtx6000-ada")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--overload", type=float, default=1.5, help="check 1's rate / saturated throughput")
    ap.add_argument("--burstiness", type=float, default=0.1, help="check 2's gamma shape (1 = Poisson)")
    ap.add_argument("--partition-rate", type=float, default=10.0, help="check 3's rate, req/s")
    ap.add_argument("--encode-overhead-s", type=overhead_seconds, default=0.0,
                    help="the stacks' fixed cost per encode call, seconds (bench/paper_setting.py fits it)")
    ap.add_argument("--quick", action="store_true", help="60 requests per run")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = 60
    return args


def worker(i: int, tp: int, **flags) -> Worker:
    return Worker(device=f"cuda:{i * tp}", tp=tp, flags={k.replace("_", "-"): v for k, v in flags.items()})


def deployment(model: str, tp: int, encode: dict, n_enc: int, n_pre: int, n_dec: int) -> Deployment:
    slots = iter(range(n_enc + n_pre + n_dec))
    return Deployment(name="check", model=model, encode=tuple(worker(next(slots), tp, **encode) for _ in range(n_enc)),
                      prefill=tuple(worker(next(slots), tp) for _ in range(n_pre)),
                      decode=tuple(worker(next(slots), tp) for _ in range(n_dec)))


def run(d: Deployment, prof, modality: str, rate: float, args, burstiness: float = 1.0) -> dict:
    cfg = BenchConfig(url="http://simulated.invalid", rate=rate, burstiness=burstiness, num_requests=args.requests,
                      seed=0, workload=WorkloadSpec(modality=modality, **WORKLOAD), ignore_eos=True,
                      slo=prof.slo("moderate"), progress=False)
    m = run_simulation(d, prof, cfg)[0].metrics
    return {k: round(float(m[k]), 4) if m.get(k) is not None else None for k in KEYS}


def saturated(d: Deployment, prof, modality: str, args) -> float:
    return run(d, prof, modality, args.requests * 1.0, args)["request_throughput"]


def change(a: float | None, b: float | None) -> float | None:
    return round(b / a - 1, 3) if a and b is not None else None


def main(argv=None) -> int:
    args = args_of(argv)
    spec = with_encode_overhead(load_spec(args.gpu), args.encode_overhead_s)
    llava = str(ROOT / "bench" / "paper_models" / MODELS["image"])
    ultravox = str(ROOT / "bench" / "paper_models" / MODELS["audio"])
    p_img, p_aud = build(llava, spec, args.tp), build(ultravox, spec, args.tp)
    out: dict = {}

    one = deployment(llava, args.tp, {"max_batch": 1, "batch_mode": "request_at_a_time"}, 1, 1, 2)
    eight = deployment(llava, args.tp, {"max_batch": 8, "batch_mode": "fixed"}, 1, 1, 2)
    rate = round(args.overload * saturated(one, p_img, "image", args), 3)
    a, b = run(one, p_img, "image", rate, args), run(eight, p_img, "image", rate, args)
    out["fixed8"] = {"rate": rate, "request_at_a_time": a, "fixed_8": b,
                     "ours": {"throughput": (a["request_throughput"], b["request_throughput"]),
                              "mean_ttft_s": (a["mean_ttft_ms"] / 1e3, b["mean_ttft_ms"] / 1e3),
                              "mean_tpot_ms": (a["mean_tpot_ms"], b["mean_tpot_ms"])},
                     "paper": PAPER["fixed8"]}

    default = deployment(llava, args.tp, {"max_batch": 8, "batch_mode": "adaptive"}, 1, 1, 2)
    rate = round(0.9 * saturated(default, p_img, "image", args), 3)
    a, b = run(default, p_img, "image", rate, args), run(default, p_img, "image", rate, args, args.burstiness)
    out["bursty"] = {"rate": rate, "poisson": a, f"gamma_{args.burstiness:g}": b,
                     "ours": {"throughput_change": change(a["request_throughput"], b["request_throughput"]),
                              "p99_ttft_s": (a["p99_ttft_ms"] / 1e3, b["p99_ttft_ms"] / 1e3)},
                     "paper": PAPER["bursty"]}

    coloc = {"max_batch": 8, "batch_mode": "adaptive", "colocate_prefill": True, "remote_fraction": 0.5}
    ts = deployment(ultravox, args.tp, {**coloc, "sm_backend": "timeslice", "partition_policy": "timeslice"}, 2, 1, 1)
    dyn = deployment(ultravox, args.tp, {**coloc, "sm_backend": "auto", "partition_policy": "dynamic"}, 2, 1, 1)
    a, b = run(ts, p_aud, "audio", args.partition_rate, args), run(dyn, p_aud, "audio", args.partition_rate, args)
    out["partition"] = {"rate": args.partition_rate, "timeslice": a, "dynamic": b,
                        "ours": {"throughput_change": change(a["request_throughput"], b["request_throughput"]),
                                 "p99_ttft_change": change(a["p99_ttft_ms"], b["p99_ttft_ms"]),
                                 "p99_tpot_change": change(a["p99_tpot_ms"], b["p99_tpot_ms"])},
                        "paper": PAPER["partition"]}
    for name, r in out.items():
        print(f"{name} at {r['rate']} req/s")
        for k, v in r["ours"].items():
            print(f"  {k:<18} ours {v}   paper {r['paper'][k]}")
    out["quick"], out["encode_call_overhead_s"] = args.quick, args.encode_overhead_s
    finish("paper_secondary", args, out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
