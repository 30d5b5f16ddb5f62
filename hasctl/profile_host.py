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


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_of(fields: list[str]) -> float:
    """utime + stime of stat_fields, seconds (fields 14 and 15 of stat)."""
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> float | None:
    """utime + stime of `pid` alone so far, seconds (None once it is gone)."""
    f = stat_fields(pid)
    return None if f is None else cpu_of(f)


def tree_cpu_s(pids: list[int]) -> float:
    """utime + stime of `pids` and all their descendants, seconds."""
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (f := stat_fields(d)) is not None:
            stats[int(d)] = f
            kids.setdefault(int(f[1]), []).append(int(d))
    total, todo = 0.0, list(pids)
    while todo:
        p = todo.pop()
        if p in stats:
            total += cpu_of(stats[p])
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


# ---- the file `hasctl profile --host-work` writes, and what the simulator takes from it -------------
PRESETS_MEASURED = ("default", "monolith")  # E/P/D stages, and a monolith process


def measure_stacks(model: str, spec, run_dir: Path, requests: int = 40, concurrency: int = 4) -> dict:
    """{"default": measure_host_work(...), "monolith": ...}: each preset started on `model`,
    warmed up with a few requests, measured, stopped."""
    from hasctl.bench import BenchConfig, run_bench
    from hasctl.deployment import preset
    from hasctl.launch import Stack
    import dataclasses
    out: dict = {"model": model, "workload": dataclasses.asdict(spec)}
    for name in PRESETS_MEASURED:
        stack = Stack(preset(name).with_model(model).with_gateway_ports(0, 0), run_dir=Path(run_dir) / name,
                      env={"EASERVE_LOG_LEVEL": "WARNING"})
        try:
            stack.start(timeout=600)
            asyncio.run(run_bench(BenchConfig(url=stack.endpoints.http, rate=4.0, num_requests=4, seed=99,
                                              workload=spec, progress=False)))
            out[name] = measure_host_work(stack, spec, requests=requests, concurrency=concurrency)
        finally:
            stack.stop()
    return out


def media_label(profile, modality: str) -> str:
    """The profile's reference media size of `modality` (its first by_size point), "" when it has none."""
    enc = profile.encode
    return next((p.media for p in enc.by_size if p.modality == modality), "") if enc else ""


def host_s_for(doc: dict, deployment, profile, modality: str) -> tuple[tuple[str, float], ...]:
    """`ModelConfig.host_s` of `deployment` from a host-work file: a monolith takes the monolith
    preset's stages, any other deployment the default preset's; the gateway's less the profile's
    preprocessing time for the modality's reference media (the simulator's gateway already
    spends that on its preprocessing threads)."""
    missing = [k for k in PRESETS_MEASURED if k not in doc]
    if missing:
        raise ValueError(f"the host-work file lacks {missing}; re-run hasctl profile --host-work")
    src = dict(doc["monolith" if deployment.monolith else "default"]["host_s"])
    label = media_label(profile, modality)
    src["gateway"] = max(0.0, src.get("gateway", 0.0) - profile.gateway_latency(modality, label or None))
    return tuple(sorted(src.items()))


def load(path: str | Path) -> dict:
    import json
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--host-work {path}: cannot read it ({e}); write one with hasctl profile --host-work") from None


def spec_for(profile, output_tokens: int = 32):
    """The WorkloadSpec of the profile's reference media (its first modality's first size)."""
    from hasctl.workload import WorkloadSpec
    enc = profile.encode
    point = enc.by_size[0] if enc and enc.by_size else None
    if point is None:
        return WorkloadSpec(modality="text", output_tokens=output_tokens)
    if point.modality == "image":
        w, h = (int(x) for x in point.media.split("x"))
        return WorkloadSpec(modality="image", image_size=(w, h), output_tokens=output_tokens)
    if point.modality == "video":
        f, w, h = (int(x) for x in point.media.split("x"))
        return WorkloadSpec(modality="video", video_frames=f, video_size=(w, h), output_tokens=output_tokens)
    return WorkloadSpec(modality="audio", audio_s=float(point.media.rstrip("s")), output_tokens=output_tokens)


def run_cli(args, profile) -> None:
    """`hasctl profile --host-work OUT`: measure_stacks on --host-work-model (default: the tiny
    checkpoint of the profiled model's family, built beside OUT) and write OUT."""
    import json
    model = args.host_work_model
    if model is None:
        from easerve.models.tiny import cached_tiny
        model = str(cached_tiny(profile.model.family, Path(args.host_work).parent / "tiny"))
    doc = measure_stacks(model, spec_for(profile), Path(args.host_work).parent / "host-work-run")
    Path(args.host_work).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.host_work}: host CPU per request, default: "
          + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in doc["default"]["host_s"].items())
          + "; monolith: " + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in doc["monolith"]["host_s"].items()))
