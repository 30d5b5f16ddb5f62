"""A mixed image / video / audio workload on one cluster (issue 20, part 4), in the simulator.

No paper model serves all three modalities, so the cluster runs the three paper models side by
side (bench/paper_models: LLaVA-v1.6-34B for images, Qwen2.5-VL-32B for video, Ultravox-27B for
audio), each on whole nodes of its own; the traffic is a mix (`--mix`, shares of requests). The
question a platform engineer asks: how many nodes each model gets, and what mixed rate the
cluster then carries within the moderate tier.

1. Per modality, one node's best E/P/D allocation and its goodput g (bench/scaling.py,
   `one_node`: roofline profiles, every allocation of the node's slots, 20 s or longer cells).
2. The split: nodes n per model (each >= 1, summing to --nodes) maximizing the mixed rate R with
   n * g >= share * R for every model (`best_split`; models on separate nodes do not share compute,
   and repeating a node's allocation scales at ~1 per node: docs/scaling.md).
3. Each model's n-node deployment simulated at its share of R: the met fraction of its requests
   (a check of step 2), beside the even split's R.

  python bench/mixed_cluster.py --quick        # 8 x 8 H100, mix image 0.3 / video 0.2 / audio 0.5
Last stdout line: JSON with "mixed_req_s" (R), "split" (nodes per modality), "even_split_req_s",
"per_node_req_s" and "check" (per modality: rate, goodput, SLO attainment at its share of R).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.harness.results import finish  # noqa: E402

from paper_setting import MODELS, WORKLOAD  # noqa: E402
from scaling import goodput, one_node, parse_ladder, per_node  # noqa: E402

from easerve.roofline import load_spec  # noqa: E402
from hasctl.roofline_profile import build  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--mix", default="image=0.3,video=0.2,audio=0.5", help="shares of the requests per modality")
    args = parse_ladder(ap, argv)
    try:
        args.mix = {k.strip(): float(v) for k, v in (kv.split("=") for kv in args.mix.split(",") if kv.strip())}
    except ValueError:
        ap.error("--mix takes modality=share pairs, e.g. image=0.3,video=0.2,audio=0.5")
    if not args.mix or any(m not in MODELS for m in args.mix) or any(v <= 0 for v in args.mix.values()):
        ap.error(f"--mix: modalities from {sorted(MODELS)}, each share > 0; got {args.mix}")
    if args.nodes < len(args.mix):
        ap.error(f"--nodes must be at least one per modality ({len(args.mix)}), got {args.nodes}")
    total = sum(args.mix.values())
    args.mix = {k: v / total for k, v in args.mix.items()}
    return args


def mixed_rate(split: dict[str, int], per_node: dict[str, float], mix: dict[str, float]) -> float:
    """The mixed rate R that `split` (nodes per modality) carries: the least of n * g / share."""
    return min(split[m] * per_node[m] / mix[m] for m in mix)


def best_split(nodes: int, per_node: dict[str, float], mix: dict[str, float]) -> tuple[dict[str, int], float]:
    """Nodes per modality (each >= 1, summing to `nodes`) of the highest mixed rate; ties go to
    the split listed first (fewer nodes to the earlier modalities)."""
    mods = list(mix)
    best: tuple[dict[str, int], float] = ({}, -1.0)
    for cut in itertools.combinations(range(1, nodes), len(mods) - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, nodes))]
        split = dict(zip(mods, counts))
        r = mixed_rate(split, per_node, mix)
        if r > best[1]:
            best = (split, r)
    return best


def even_split(nodes: int, mods: list[str]) -> dict[str, int]:
    q, r = divmod(nodes, len(mods))
    return {m: q + (1 if i < r else 0) for i, m in enumerate(mods)}


def main(argv=None) -> int:
    args = args_of(argv)
    dev = load_spec(args.gpu)
    per, tp = args.gpus_per_node, args.tp
    models = {m: str(ROOT / "bench" / "paper_models" / MODELS[m]) for m in args.mix}
    g1, alloc, profs, specs = {}, {}, {}, {}
    for m, model in models.items():
        profs[m], specs[m] = build(model, dev, tp), WorkloadSpec(modality=m, **WORKLOAD)
        a, g, _ = one_node(model, profs[m], specs[m], per, tp, args)
        alloc[m], g1[m] = a, g[0]
    split, rate = best_split(args.nodes, g1, args.mix)
    even = even_split(args.nodes, list(args.mix))
    even_rate = mixed_rate(even, g1, args.mix)
    check = {}
    for m, n in split.items():
        r = round(args.mix[m] * rate, 3)
        g, _ = goodput(per_node(alloc[m], n, per, tp, models[m]), profs[m], specs[m], [r], args.requests * n, per,
                       args.min_duration_s)
        check[m] = {"rate": r, "goodput": g, "slo_attainment": round(g / r, 3) if r > 0 else None}
    rows = ["| modality | model | share | nodes | allocation per node | one node req/s | rate at R | goodput there |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {m} | {MODELS[m]} | {args.mix[m]:.2f} | {split[m]} | {alloc[m].name} | {g1[m]:.2f} | "
             f"{check[m]['rate']:.2f} | {check[m]['goodput']:.2f} |" for m in args.mix]
    print("\n".join([f"# Mixed workload on {args.nodes} x {per} {dev.name} (tp {tp}){' (quick)' if args.quick else ''}",
                     "", *rows, "", f"mixed rate R = {rate:.2f} req/s (even split {even}: "
                     f"{even_rate:.2f} req/s)"]))
    finish("mixed_cluster", args, {"mixed_req_s": round(rate, 3), "split": split, "even_split": even,
                      "even_split_req_s": round(even_rate, 3),
                      "per_node_req_s": {m: round(v, 3) for m, v in g1.items()},
                      "allocation": {m: a.name for m, a in alloc.items()}, "mix": args.mix, "check": check,
                      "quick": args.quick}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
