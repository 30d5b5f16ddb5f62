"""`hasctl profile`'s sharing curve (profile revision 4, `sharing`; docs/profile-format.md): on
CPU cores, each stage's reference call timed alone and while k other processes compute on the
same cores, k = 1 .. max_busy, for each kind of neighbour (encode, prefill, decode).

The measuring process is `python -m hasctl.profile_sharing measure MODEL THREADS MAX_BUSY CORES PLAN`,
started with SHARED_CORES_ENV (hasctl/deployment.py), the environment of the stages that share
cores. A neighbour is `python -m hasctl.profile_sharing MODEL THREADS KIND PLAN`: a process of its own (its
own interpreter and torch thread pool, as a stage's), on the cores it inherits, that loads the
checkpoint, prints "ready" and runs KIND's reference call in a loop until it is terminated.
The reference calls (`reference_calls`): encode of one item of the reference media, prefill of
one prompt of the plan's middle length, and decode steps of a batch of 4 at the smallest profiled
context. The slowdown of a point is the median call while k neighbours run over the median alone.
Revision 6 adds `shared_env`: each reference call alone in that process over the same call
alone in the profiling process (where the grid is timed, in the environment it was started
with): what the shared-cores environment itself costs a stage.
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
from collections.abc import Callable

from easerve import profile_format as pf
from hasctl.deployment import SHARED_CORES_ENV
from hasctl.profile_measure import Profiler
from hasctl.profile_plan import QUICK, Plan, reference_size

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0
DECODE_BATCH = 4
DECODE_STEPS = 4     # decode steps per timed call


def reference_calls(prof: Profiler) -> dict[str, Callable[[], object]]:
    plan, calls = prof.plan, {}
    if prof.modalities:
        ref = prof.modalities[0]
        items = [prof.media_item(ref, reference_size(plan, ref))]
        calls["encode"] = lambda: prof.enc.encode(items)
    lens = sorted(plan.prompt_lens)
    reqs = prof.prefill_reqs(lens[len(lens) // 2], 1)
    calls["prefill"] = lambda: prof.lm.prefill(reqs)
    calls["decode"] = decode_call(prof, DECODE_BATCH, min(plan.decode_contexts))
    return calls


def decode_call(prof: Profiler, batch: int, ctx: int) -> Callable[[], object]:
    """DECODE_STEPS steps of an engine that keeps `batch` requests of `ctx` tokens running."""
    from easerve.engine.detok import prompt_tail
    from easerve.types import KVPayload
    [req] = prof.prefill_reqs(ctx, 1, max_tokens=64)
    res = prof.lm.prefill([req])[0]
    engine = prof.decode_engine(batch, ctx + 64 + 16)
    n = [0]

    def fill() -> None:
        while engine.stats().running + engine.stats().waiting < batch:
            n[0] += 1
            engine.add(KVPayload(f"s{n[0]}", res.keys, res.values, res.prompt_len, res.rope_delta, 11,
                                 req.sampling, prompt_tail(req.input_ids)))

    def call() -> None:
        for _ in range(DECODE_STEPS):
            fill()
            engine.step()
        prof.sync()
    return call


def measure_sharing(prof: Profiler, threads: int, cores: int, max_busy: int,
                    quick: bool = False) -> tuple[list[pf.SharingPoint], list[pf.SharedEnvPoint]]:
    """Every stage's reference call with k = 1 .. max_busy neighbours of each kind on these cores,
    measured in a process of its own started with SHARED_CORES_ENV, as are its neighbours: the
    stages that share cores run with it (OpenMP threads that sleep at a barrier), and this
    process's own thread pool started without it. Spinning threads measure another machine:
    bench/sharing_env.py (bench/results/sharing_env/) has both curves side by side. Also each
    reference call alone there over the same call alone here (`shared_env`), timed just before."""
    if prof.device.startswith("cuda") or max_busy < 1:
        return [], []
    here = {stage: prof.timed(fn) for stage, fn in reference_calls(prof).items()}
    alone: dict[str, float] = {}
    points = run_measurement(prof.model, threads, max_busy, cores, quick, dict(SHARED_CORES_ENV), prof.tick, alone)
    env = [pf.SharedEnvPoint(stage, alone[stage] / here[stage]) for stage in here if stage in alone]
    return [pf.SharingPoint(**x) for x in points], env


def run_measurement(model: str, threads: int, max_busy: int, cores: int, quick: bool, env: dict[str, str],
                    tick: Callable[[str], None] | None = None, alone: dict[str, float] | None = None) -> list[dict]:
    """`measure_here` in a process of its own whose environment is this one's without the
    SHARED_CORES_ENV variables, plus `env` (its neighbours inherit it); its points as dicts.
    `alone`, when given, receives each reference call's time alone there (seconds)."""
    env = {**{k: v for k, v in os.environ.items() if k not in dict(SHARED_CORES_ENV)}, **env}
    p = subprocess.Popen([sys.executable, "-m", "hasctl.profile_sharing", "measure", model, str(threads),
                          str(max_busy), str(cores), "quick" if quick else "full"],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    points = None
    for line in p.stdout:
        if line.startswith("tick "):
            if tick is not None:
                tick(line[5:].strip())
        elif line.startswith("env "):
            log.info("sharing measured with %s", line[4:].strip())
        elif line.startswith("alone "):
            if alone is not None:
                alone.update(json.loads(line[6:]))
        elif line.startswith("points "):
            points = json.loads(line[7:])
    if p.wait() != 0 or points is None:
        raise RuntimeError(f"the sharing measurement failed (exit {p.returncode}); its error is above")
    return points


def measure_here(model: str, threads: int, max_busy: int, cores: int, plan: str) -> None:
    """The body of `run_measurement`, in the process it starts: prints "tick WHAT" lines,
    "alone JSON" (stage -> seconds) and, last, "points JSON"."""
    import torch
    torch.set_num_threads(threads)
    print("env " + " ".join(f"{k}={os.environ.get(k, '')}" for k, _ in SHARED_CORES_ENV), flush=True)
    quick = plan == "quick"
    prof = Profiler(model, "cpu", QUICK if quick else Plan())
    calls = reference_calls(prof)
    alone = {stage: prof.timed(fn) for stage, fn in calls.items()}
    print("alone " + json.dumps(alone), flush=True)
    out = []
    for kind in calls:
        procs: list[subprocess.Popen] = []
        try:
            for k in range(1, max_busy + 1):
                procs.append(start_neighbour(model, threads, kind, quick))
                for stage, fn in calls.items():
                    out.append(dict(stage=stage, by=kind, busy=k, slowdown=max(1.0, prof.timed(fn) / alone[stage]),
                                    cores=cores))
                print(f"tick sharing {kind} x{k}", flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    print("points " + json.dumps(out), flush=True)


def start_neighbour(model: str, threads: int, kind: str, quick: bool) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "hasctl.profile_sharing", model, str(threads), kind,
                          "quick" if quick else "full"],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([p.stdout], [], [], READY_TIMEOUT_S)
    line = p.stdout.readline().strip() if ready else ""
    if line != "ready":
        p.kill()
        p.wait()
        raise RuntimeError(f"the {kind} neighbour process did not start (said {line!r}, exit {p.returncode})")
    return p


def neighbour(model: str, threads: int, kind: str, plan: str) -> None:
    import torch

    parent = os.getppid()
    torch.set_num_threads(threads)
    prof = Profiler(model, "cpu", QUICK if plan == "quick" else Plan())
    fn = reference_calls(prof)[kind]
    fn()
    print("ready", flush=True)
    while os.getppid() == parent:  # the profiler went away without terminating it: stop too
        fn()


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        measure_here(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        neighbour(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
