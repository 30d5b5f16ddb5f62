"""Measure this CPU's device spec for the roofline model (easerve/roofline/specs/*.json): fp32
matmul FLOP/s (torch, square matmuls on every allowed core, best of a few) and read bandwidth
(a sum over a 256 MiB tensor, far past the caches). Prints the spec JSON; `--out FILE` writes it.

    python scripts/measure_cpu_spec.py --name cpu-epyc-2c --out easerve/roofline/specs/cpu-epyc-2c.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def best_of(fn, repeats: int = 5) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--n", type=int, default=1536, help="matmul side")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    a, b = torch.randn(args.n, args.n), torch.randn(args.n, args.n)
    tflops = 2 * args.n ** 3 / best_of(lambda: a @ b) / 1e12
    x = torch.ones(64 << 20)  # 256 MiB of fp32
    gbps = x.numel() * 4 / best_of(lambda: x.sum()) / 1e9
    cpu = platform.processor() or "cpu"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    spec = {"name": args.name, "tflops": round(tflops, 4), "mem_gb_per_s": round(gbps, 2), "mem_gib": round(mem, 1),
            "sm_count": cores, "interconnect_gb_per_s": round(gbps, 2),
            "source": f"measured by scripts/measure_cpu_spec.py on {cpu}, {cores} cores: fp32 {args.n}^2 matmul "
                      f"(torch {torch.__version__}), read bandwidth of a 256 MiB sum; interconnect = memory "
                      "(stages on one host share its memory)",
            "dtype": "fp32"}
    text = json.dumps(spec, indent=1) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
