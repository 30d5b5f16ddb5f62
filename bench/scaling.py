"""Past the paper (issue 20, part 4), in the simulator: one modality's paper model on more nodes.

1. One node (--gpus-per-node GPUs of --gpu, tp --tp groups): the best E/P/D allocation over all of
   the node's slots (encode adaptive B = 8, every prefill remote), and the vLLM-like monoliths.
2. --nodes nodes at each --network-gbps: that allocation repeated per node ("per node": each node
   holds a copy; the gateway and encode still place work on the least-loaded instance anywhere, so
   some embeddings and KV cross nodes) and split by stage ("by stage": encode and prefill first,
   decode on the last nodes, so every KV crosses): goodput, goodput per GPU and the scale
   efficiency (goodput per GPU / one node's). Rates: the one-node ladder x nodes.
3. --big-gpu x --big-nodes nodes (64 H100s by default, tp 1) at a proportional rate: the one-node
   best of that GPU, repeated per node, at the highest network rate (its ladder: the one-node
   ladder x its compute per instance over --gpu's, x nodes).

Each cell is the best of rate x SLO attainment over the ladder (moderate tier of the roofline
profile's own unloaded latencies, as bench/paper_setting.py). Cross-node transfers cost
`latency + bytes / (Gb/s / 8)` per message (`hasctl profile --roofline --network-gbps`), links not
contended (easerve/policy/service_model.py), so a cell shows where a transfer's time binds, not a full NIC.

Where a NIC would bind: `kv_mb_per_request` (the KV of one request's prompt) and, per Gb/s,
`nic_req_s`, the requests per second whose KV alone fills one node's link (Gb/s / 8 / KV bytes).

  python bench/scaling.py --quick --modality image      # 40 requests per node per cell, 5 rates
Last stdout line: JSON with "scale_efficiency" per (nodes, Gb/s, placement), "goodput",
"per_gpu", the allocations chosen, "kv_mb_per_request" and "nic_req_s".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.harness.results import add_save_flag, finish  # noqa: E402

from paper_setting import MODELS, WORKLOAD, vllm_like  # noqa: E402

from easerve.roofline import load_arch, load_spec  # noqa: E402
from easerve.policy.service_model import ModelConfig  # noqa: E402
from hasctl.bench import BenchConfig  # noqa: E402
from hasctl.deployment import Deployment, Worker  # noqa: E402
from hasctl.roofline_profile import (
    TEXT_TOKENS,  # noqa: E402
    build,  # noqa: E402
)
from hasctl.screen import Allocation, enumerate_allocations  # noqa: E402
from hasctl.simulate import PROFILE_TEXT_TOKENS, media_of, run_simulation  # noqa: E402
from hasctl.workload import WorkloadSpec, steady_requests  # noqa: E402

ENCODE = {"max-batch": 8, "batch-mode": "adaptive", "remote-fraction": 1.0}


def parse_ladder(ap, argv=None):
    """Add the one-node rate ladder's flags (--requests, --rates, --min-duration-s, --quick,
    --save; bench/mixed_cluster.py's too) and parse."""
    ap.add_argument("--requests", type=int, default=200, help="requests per node per cell, at least")
    ap.add_argument("--rates", default="0.5,1,2,3,4,6,8,12,16,24", help="one node's ladder, req/s")
    ap.add_argument("--min-duration-s", type=float, default=60.0,
                    help="each cell's arrivals last at least this long, so it reaches steady state "
                         "(bench/paper_setting.py, cell_requests)")
    ap.add_argument("--quick", action="store_true", help="40 requests per node per cell, 5 rates, 20 s cells")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rates, args.min_duration_s = 40, "2,4,8,16,32", 20.0
    args.rates = [float(x) for x in args.rates.split(",")]
    return args


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modality", default="image", choices=list(MODELS))
    ap.add_argument("--gpu", default="rtx6000-ada")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--network-gbps", default="100,400")
    ap.add_argument("--big-gpu", default="h100-sxm")
    ap.add_argument("--big-tp", type=int, default=1)
    ap.add_argument("--big-nodes", type=int, default=8)
    args = parse_ladder(ap, argv)
    args.network_gbps = [float(x) for x in args.network_gbps.split(",")]
    return args


def on(slots: list[int], tp: int, a: Allocation, model: str) -> Deployment:
    """Allocation `a` on GPU-group slots (their first GPUs), encode first, then prefill, then decode."""
    it = iter(slots)

    def ws(n: int, flags=None) -> tuple[Worker, ...]:
        return tuple(Worker(f"cuda:{next(it)}", tp=tp, flags=flags or {}) for _ in range(n))
    return Deployment(name=a.name, model=model, encode=ws(a.encode, ENCODE), prefill=ws(a.prefill), decode=ws(a.decode))


def times(a: Allocation, k: int) -> Allocation:
    return Allocation(a.encode * k, a.prefill * k, a.decode * k)


def per_node(a: Allocation, nodes: int, per: int, tp: int, model: str) -> Deployment:
    """`a` on every node: each node's slots hold one copy (listed stage by stage across nodes)."""
    copies = [on([n * per + i * tp for i in range(per // tp)], tp, a, model) for n in range(nodes)]
    return Deployment(name=f"{a.name} x{nodes} per node", model=model,
                      **{s: tuple(w for c in copies for w in getattr(c, s)) for s in ("encode", "prefill", "decode")})


def goodput(d: Deployment, prof, spec: WorkloadSpec, rates: list[float], n: int, per_host: int,
            min_s: float) -> tuple[float, float]:
    """Best rate x SLO attainment over `rates`, each cell `n` requests or `min_s` of arrivals if more."""
    best = (0.0, 0.0)
    for rate in rates:
        cfg = BenchConfig(url="http://simulated.invalid", rate=rate, num_requests=steady_requests(rate, n, min_s),
                          seed=0, workload=spec,
                          ignore_eos=True, slo=prof.slo("moderate"), progress=False)
        m = run_simulation(d, prof, cfg, ModelConfig(per_host))[0].metrics
        best = max(best, (round(rate * float(m.get("slo_attainment") or 0.0), 3), rate))
    return best


def one_node(model: str, prof, spec, gpus: int, tp: int, args, scale: float = 1.0) -> tuple[Allocation, tuple, tuple]:
    """(best allocation, its goodput, the vLLM-like goodput) on one node, the ladder x `scale`."""
    rates = [round(r * scale, 2) for r in args.rates]
    slots = [i * tp for i in range(gpus // tp)]
    allocs = [a for a in enumerate_allocations(len(slots)) if not a.colocated]
    found = [(goodput(on(slots, tp, a, model), prof, spec, rates, args.requests, gpus, args.min_duration_s), a)
             for a in allocs]
    g, a = max(found, key=lambda x: x[0])
    v = goodput(vllm_like(model, [f"cuda:{s}" for s in slots], prof, spec, tp), prof, spec, rates, args.requests, gpus,
                args.min_duration_s)
    return a, g, v


def main(argv=None) -> int:
    args = args_of(argv)
    model = str(ROOT / "bench" / "paper_models" / MODELS[args.modality])
    spec = WorkloadSpec(modality=args.modality, **WORKLOAD)
    per, tp, k = args.gpus_per_node, args.tp, args.nodes
    res: dict = {"modality": args.modality, "goodput": {}, "per_gpu": {}, "scale_efficiency": {}, "allocation": {}}
    rows = ["| cluster | network | placement | allocation | goodput req/s | per GPU | scale efficiency |",
            "| --- | --- | --- | --- | --- | --- | --- |"]

    def record(key: str, cluster: str, net: str, place: str, alloc: str, g: float, gpus: int, base: float) -> None:
        eff = round(g / gpus / base, 3) if base > 0 else None
        res["goodput"][key], res["per_gpu"][key], res["allocation"][key] = g, round(g / gpus, 4), alloc
        if not key.startswith("1-node"):
            res["scale_efficiency"][key] = eff
        rows.append(f"| {cluster} | {net} | {place} | {alloc} | {g:.2f} | {g / gpus:.3f} | {eff} |")

    dev = load_spec(args.gpu)
    prof = build(model, dev, tp)
    best, g1, v1 = one_node(model, prof, spec, per, tp, args)
    base = g1[0] / per
    record("1-node", f"1 x {per} {dev.name}", "-", "-", best.name, g1[0], per, base)
    record("1-node/vllm-like", f"1 x {per} {dev.name}", "-", "vLLM-like", f"{per // tp} monoliths", v1[0], per, base)
    rates = [r * k for r in args.rates]
    for gbps in args.network_gbps:
        p = build(model, dev, tp, network_gbps=gbps)
        big = times(best, k)
        for place, d in (("per node", per_node(best, k, per, tp, model)),
                         ("by stage", on([i * tp for i in range(k * per // tp)], tp, big, model))):
            g = goodput(d, p, spec, rates, args.requests * k, per, args.min_duration_s)[0]
            record(f"{k}-node/{gbps:g}/{place}", f"{k} x {per} {dev.name}", f"{gbps:g} Gb/s", place, big.name, g,
                   k * per, base)
    bdev = load_spec(args.big_gpu)
    bprof = build(model, bdev, args.big_tp)
    fast = bdev.tflops * tp / (dev.tflops * args.big_tp)  # its ladder: x its compute per instance
    bbest, bg1, _ = one_node(model, bprof, spec, per, args.big_tp, args, fast)
    bbase = bg1[0] / per
    record(f"1-node-{bdev.name}", f"1 x {per} {bdev.name}", "-", "-", bbest.name, bg1[0], per, bbase)
    gbps = max(args.network_gbps)
    bp = build(model, bdev, args.big_tp, network_gbps=gbps)
    n = args.big_nodes
    g = goodput(per_node(bbest, n, per, args.big_tp, model), bp, spec, [round(r * n * fast, 2) for r in args.rates],
                args.requests * n, per, args.min_duration_s)[0]
    record(f"{n}-node-{bdev.name}/{gbps:g}/per node", f"{n} x {per} {bdev.name}", f"{gbps:g} Gb/s", "per node",
           times(bbest, n).name, g, n * per, bbase)
    print("\n".join([f"# Scaling, {args.modality} ({MODELS[args.modality]}){' (quick)' if args.quick else ''}", "",
                     *rows]))
    prompt = spec.input_tokens + TEXT_TOKENS - PROFILE_TEXT_TOKENS + load_arch(model).rows(args.modality,
                                                                                        media_of(spec, args.modality))
    kv = prompt * prof.transfer.kv_bytes_per_token
    res["kv_mb_per_request"] = round(kv / 1e6, 1)
    res["nic_req_s"] = {f"{g:g}": round(g / 8 * 1e9 / kv, 2) for g in args.network_gbps}
    res["quick"] = args.quick
    finish("scaling", args, res, argv, folder=f"scaling-{args.modality}")  # one stored run per modality
    return 0


if __name__ == "__main__":
    sys.exit(main())
