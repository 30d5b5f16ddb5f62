"""`hasctl profile`'s sharing curve (profile revision 4, `sharing`; docs/profile-format.md): on
CPU cores, each stage's reference call timed alone and while k other processes compute on the
same cores, k = 1 .. max_busy, for each kind of neighbour (encode, prefill, decode).

A neighbour is `python -m hasctl.profile_sharing MODEL THREADS KIND PLAN`: a process of its own (its
own interpreter and torch thread pool, as a stage's), on the cores it inherits, that loads the
checkpoint, prints "ready" and runs KIND's reference call in a loop until it is terminated.
The reference calls (`reference_calls`): encode of one item of the reference media, prefill of
one prompt of the plan's middle length, and decode steps of a batch of 4 at the smallest profiled
context. The slowdown of a point is the median call while k neighbours run over the median alone.
"""
from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Callable

from easerve import profile_format as pf
from hasctl.profile_measure import Profiler
from hasctl.profile_plan import QUICK, Plan, reference_size

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


def measure_sharing(prof: Profiler, threads: int, cores: int, max_busy: int, quick: bool = False) -> list[pf.SharingPoint]:
    """Every stage's reference call with k = 1 .. max_busy neighbours of each kind on these cores."""
    if prof.device.startswith("cuda") or max_busy < 1:
        return []
    calls = reference_calls(prof)
    alone = {stage: prof.timed(fn) for stage, fn in calls.items()}
    out = []
    for kind in calls:
        procs: list[subprocess.Popen] = []
        try:
            for k in range(1, max_busy + 1):
                procs.append(start_neighbour(prof.model, threads, kind, quick))
                for stage, fn in calls.items():
                    out.append(pf.SharingPoint(stage, kind, k, max(1.0, prof.timed(fn) / alone[stage]), cores))
                prof.tick(f"sharing {kind} x{k}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return out


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
    import os

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
    neighbour(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
