"""What bringing a stage process back costs: cold start, promoted standby, fork, same run.

    python bench/restart_cost.py [--repeats 3] [--scale bench]

For encode, prefill and decode of the random-weight Qwen2.5-VL at `--scale`, `--repeats`
rounds, the three ways taken in turn within each round (nothing else should run on the cores):
  cold     `python -m services.<stage> ...`: CPU seconds and wall seconds from the start to
           SERVING (gRPC health of the stage's service)
  standby  `python -m hasctl.standby`: the CPU its imports take ahead of need (`ahead_cpu_s`,
           spent beside the serving processes each time a standby is replaced), then from the
           "go" line to SERVING (the restart itself)
  fork     a child of `hasctl.forked.ForkServer` (the server's one-off imports: `server_cpu_s`):
           from the request to SERVING
The medians per stage and way; `cpu_per_restart_s` counts what each restart costs the machine
(standby: ahead + after go; fork: the child's). Last stdout line: JSON, ratios first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness.results import add_save_flag, finish  # noqa: E402
from hasctl.forked import ForkServer  # noqa: E402
from hasctl.launch import free_port, health_ok  # noqa: E402
from hasctl.profile_host import cpu_s  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"encode": ("easerve.v1.Encode", ["--prefill", "127.0.0.1:9"]),
          "prefill": ("easerve.v1.Prefill", ["--decode", "127.0.0.1:9"]),
          "decode": ("easerve.v1.Decode", [])}


def argv_of(stage: str, model: str, port: int) -> list[str]:
    return [sys.executable, "-m", f"services.{stage}", "--model", model, "--device", "cpu",
            "--listen", f"127.0.0.1:{port}", "--threads", "1", *STAGES[stage][1]]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EASERVE_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}


def until_serving(stage: str, port: int, pid: int, poll, t0: float, timeout: float = 300.0) -> tuple[float, float]:
    """(CPU seconds of `pid` so far, wall seconds since t0) once the stage answers SERVING."""
    while not health_ok(f"127.0.0.1:{port}", STAGES[stage][0], timeout=0.5):
        if poll() is not None:
            raise RuntimeError(f"{stage} exited with code {poll()} before SERVING")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{stage} not SERVING after {timeout:.0f} s")
        time.sleep(0.02)
    return cpu_s(pid), time.monotonic() - t0


def stop(p) -> None:
    try:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass
    p.wait()


def cold(stage: str, model: str, log) -> dict:
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.Popen(argv_of(stage, model, port), stdout=log, stderr=log, env=env(), cwd=ROOT,
                         start_new_session=True)
    try:
        cpu, wall = until_serving(stage, port, p.pid, p.poll, t0)
    finally:
        stop(p)
    return {"cpu_per_restart_s": cpu, "wall_to_serving_s": wall}


def standby(stage: str, model: str, log, tmp: Path) -> dict:
    port, ready = free_port(), tmp / f"{stage}.ready"
    ready.unlink(missing_ok=True)
    argv = argv_of(stage, model, port)
    p = subprocess.Popen([argv[0], "-m", "hasctl.standby", str(ready), *argv[2:]], stdin=subprocess.PIPE,
                         stdout=log, stderr=log, env=env(), cwd=ROOT, start_new_session=True)
    try:
        while not ready.exists():
            if p.poll() is not None:
                raise RuntimeError(f"the {stage} standby exited with code {p.returncode}")
            time.sleep(0.02)
        time.sleep(0.5)  # its imports are done: idle from here
        ahead = cpu_s(p.pid)
        t0 = time.monotonic()
        p.stdin.write(b"go\n")
        p.stdin.close()
        cpu, wall = until_serving(stage, port, p.pid, p.poll, t0)
    finally:
        stop(p)
    return {"ahead_cpu_s": ahead, "after_go_cpu_s": cpu - ahead, "cpu_per_restart_s": cpu,
            "wall_to_serving_s": wall}


def forked(stage: str, model: str, server: ForkServer, log_path: str) -> dict:
    port = free_port()
    t0 = time.monotonic()
    child = server.spawn(tuple(argv_of(stage, model, port)), log_path, env(), str(ROOT))
    try:
        cpu, wall = until_serving(stage, port, child.pid, child.poll, t0)
    finally:
        stop(child)
    return {"cpu_per_restart_s": cpu, "wall_to_serving_s": wall}


def medians(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from easerve.models.tiny import cached_tiny
    model = str(cached_tiny("qwen2.5-vl", args.cache_dir, scale=args.scale))
    rows: dict[str, dict[str, list[dict]]] = {s: {"cold": [], "standby": [], "fork": []} for s in STAGES}
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as tmp:
        log_path = str(Path(tmp) / "stages.log")
        server = ForkServer(sys.executable, env(), str(ROOT), str(Path(tmp) / "fork-server.log"))
        try:
            with open(log_path, "ab") as log:
                for _ in range(args.repeats):
                    for stage in STAGES:
                        rows[stage]["cold"].append(cold(stage, model, log))
                        rows[stage]["standby"].append(standby(stage, model, log, Path(tmp)))
                        rows[stage]["fork"].append(forked(stage, model, server, log_path))
            server_cpu = cpu_s(server._proc.pid)
        finally:
            server.close()
    per = {s: {way: medians(r) for way, r in ways.items()} for s, ways in rows.items()}
    ratio = lambda way: {s: round(per[s]["fork"]["cpu_per_restart_s"] / per[s][way]["cpu_per_restart_s"], 3)  # noqa: E731
                         for s in STAGES}
    result = {"fork_cpu_over_standby": ratio("standby"), "fork_cpu_over_cold": ratio("cold"),
              "server_cpu_s": round(server_cpu, 2), "per_stage": per, "repeats": args.repeats,
              "scale": args.scale}
    finish("restart_cost", args, result, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
