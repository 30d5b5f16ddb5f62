"""Host work per request of each stage process of a live stack: the CPU (utime + stime of the
process and its children, from /proc) a stage spends per request outside what it idles at.

`measure_host_work(stack, spec)`: the processes' idle CPU rate over `idle_s` first (health
polls, load reports), then `requests` requests of `spec` with `concurrency` in flight (a closed
loop, `hasctl bench --max-concurrency`); per process, CPU over the run minus its idle rate times
the run's length, summed over the instances of a stage and divided by the completed requests.
On a checkpoint of negligible compute (`hasctl make-tiny`, the default scale) that is the
stack's own work per request: parsing, media, tokenization, serialization, gRPC, streaming; the
simulator charges it as core time per stage (`ModelConfig.host_s`, easerve/sim/host.py).
bench/sim_fidelity.py measures it so; bench/host_path.py reads CPU the same way.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from easerve.policy.service_model import HOST_STAGES

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pids: list[int]) -> float:
    """utime + stime of `pids` and all their descendants, seconds."""
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = f
            kids.setdefault(int(f[1]), []).append(int(d))
    total, todo = 0.0, list(pids)
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / TICK
        todo += kids.get(p, [])
    return total


def stage_of(process: str) -> str:
    """'encode-1' -> 'encode'; 'gateway' -> 'gateway'."""
    stage = process.rsplit("-", 1)[0] if process.rsplit("-", 1)[-1].isdigit() else process
    if stage not in HOST_STAGES:
        raise ValueError(f"process {process!r} is of no stage in {HOST_STAGES}")
    return stage


def per_stage(cpu_s: dict[str, float], idle_rate: dict[str, float], wall_s: float, completed: int) -> dict[str, float]:
    """Per stage: the CPU its processes spent over the run less their idle rate times its
    length, per completed request (never below 0)."""
    out: dict[str, float] = {}
    for name, cpu in cpu_s.items():
        out[stage_of(name)] = out.get(stage_of(name), 0.0) + max(0.0, cpu - idle_rate.get(name, 0.0) * wall_s)
    return {s: v / max(1, completed) for s, v in out.items()}


def measure_host_work(stack, spec, requests: int = 40, concurrency: int = 4, idle_s: float = 5.0,
                      seed: int = 4242) -> dict:
    """{"host_s": {stage: seconds per request}, "idle_core_s_per_s": {process: rate}, ...} of a
    running `hasctl.launch.Stack` serving `spec` (a hasctl.workload.WorkloadSpec)."""
    from hasctl.bench import BenchConfig, run_bench
    pids = {n: p for n, p in stack.pids.items() if p is not None}
    cpu0 = {n: tree_cpu_s([p]) for n, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(idle_s)
    idle_wall = time.monotonic() - t0
    idle = {n: (tree_cpu_s([p]) - cpu0[n]) / idle_wall for n, p in pids.items()}
    cfg = BenchConfig(url=stack.endpoints.http, rate=1e6, num_requests=requests, max_concurrency=concurrency,
                      workload=spec, ignore_eos=True, progress=False, seed=seed)
    cpu1 = {n: tree_cpu_s([p]) for n, p in pids.items()}
    t1 = time.monotonic()
    m = asyncio.run(run_bench(cfg)).metrics
    wall = time.monotonic() - t1
    cpu = {n: tree_cpu_s([p]) - cpu1[n] for n, p in pids.items()}
    done = int(m["completed"])
    return {"host_s": {s: round(v, 6) for s, v in per_stage(cpu, idle, wall, done).items()},
            "idle_core_s_per_s": {n: round(v, 4) for n, v in idle.items()},
            "requests": requests, "completed": done, "concurrency": concurrency, "wall_s": round(wall, 2)}
