"""Chaos soak: nothing lost under faults at 2x load (issue 34, item 4).

One `hasctl.launch.Stack`: 2 encode, 2 prefill and 2 decode instances of the random-weight
Qwen2.5-VL checkpoint at `--scale` (bench), restarted from the fork server that imported the
stage code once (`--restarts fork`, `hasctl.forked`) or each with a pre-imported standby
(`--restarts standby`), the gateway with `--admission reject` on a `hasctl profile` of the
checkpoint. Steps:
1. with the same deployment but admission off: the unloaded TTFT and TPOT of each modality through
   the stack (requests one at a time), and the capacity C: the completion rate of an overloaded
   open-loop probe (--probe-rate for --probe-s, the rate doubled while the stack keeps up with 70 %
   of it), the first and last 15 % of finish times dropped. The SLO (--tier, the goodput target)
   is that tier's multiple of the stack's unloaded latency (`SLO_FROM`): the profile's own tiers
   are multiples of the model's in-process latency, which on this checkpoint no request through
   the stack meets, so admission would refuse everything and goodput would be 0 either way;
2. the clean run, on a fresh stack with admission on and those tiers: seeded Poisson arrivals at
   --mult x C for --minutes, no faults;
3. the fault run: the same arrivals and bodies, with `bench/chaos_faults.py`'s schedule applied
   (kill -9 of a stage instance's process group, SIGSTOP/SIGCONT, `remove_instance` then
   `add_instance`; the link cut is reported as skipped, see LINK_CUT).
Requests: mixed image / video / text (the tiny default family serves no audio), every one greedy,
seeded, `ignore_eos`, with a deadline (`timeout`, --deadline-s); 5 % malformed (must get 400),
10 % streamed and closed by the client after a few chunks, of the rest 60 % streamed.
An outcome per request: completed, cancelled (by the client), refused_retryable (429),
failed_retryable (503, or an in-band error with code 429/503), hung (no byte for deadline + 5 s),
lost (anything else after sending: 499/500/504, a reset, a stream without [DONE]).
duplicated_or_missing_tokens: fault-run answers that differ from the clean run's answer of the
same request (both completed). recovery_s: after each kill, seconds until the goodput of the
next --window-s is back within 10 % of the clean run's mean goodput (the run's end when never);
recovery_s_clean_p99: the same figure on the clean run at the same instants (its noise floor: a
2x load's goodput per second varies with no fault at all). recovery_s_epoch: the kills superposed
(`bench/chaos_recovery.py` epoch_recovery: the fault run's good completions over the clean run's
at each second after a kill, summed over the kills), the first second from which that ratio stays
within 10 % of 1 until the next kill (null: it does not), with a bootstrap 95 % interval over the
kills; recovery_s_epoch_isolated: the same over the kills with no stop or drain from 5 s before to
10 s after them. `recovery_epoch` holds both curves.
leaks: how many of the resources in `leak_detail` (gateway and stage in-flight gauges, KV usage
and KV bytes held for decode, open client connections, unheld /dev/shm segments, fds of the
stage processes on dead /dev/shm segments, their other open fds) are higher after the fault
run, once the stack is idle and SERVING again, than before it (looked at again up to 5 times
2 s apart while any is: a leak stays). fd_growth: per stage process, the kinds of fd whose count
changed (socket, pipe, /dev/shm, /dev/shm dead, ...).
cpu_clean / cpu_faults (`bench/harness/proc_cpu.py`): the stack's CPU seconds in each run split
into starting (processes being brought back: restarts, standbys' imports, scale-ups, until
SERVING) and serving, with their shares of the machine; serving_cpu_faults_over_clean: what the
fault run had left to serve with, next to goodput_faults_over_clean.

  python bench/chaos.py --quick            # 90 s per run (the CI test)
  python bench/chaos.py --minutes 10       # the soak; last stdout line: JSON
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.admission import profile_of  # noqa: E402
from bench.chaos_faults import Fault, schedule  # noqa: E402
from bench.chaos_recovery import epoch_recovery, good_per_s, isolated, recovery_s, window_mean  # noqa: E402
from bench.harness.proc_cpu import CpuLedger  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402
from easerve.slo import RequestRecord  # noqa: E402
from hasctl.launch import StageExited  # noqa: E402
from hasctl.workload import WorkloadSpec, arrival_times, synthesize  # noqa: E402

LINK_CUT = ("skipped: Stack runs every stage in the host's network namespace and this machine has no "
            "iptables/nft to cut one port (tests/reliability/test_netns.py cuts links in its own namespaces)")
RETRYABLE = {429: "refused_retryable", 503: "failed_retryable"}
MODALITIES = ("image", "video", "text")
SLO_FROM = ("the profile's tier multipliers (2, 4, 8) of the stack's own unloaded TTFT and TPOT per modality, "
            "measured through the stack with admission off before the runs")
OUTCOMES = ("completed", "cancelled", "refused_retryable", "failed_retryable", "lost", "hung",
            "rejected_invalid", "malformed_not_400")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each run (clean, faults)")
    ap.add_argument("--quick", action="store_true", help="90 s runs (the CI test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny qwen2.5-vl at --scale)")
    ap.add_argument("--scale", default="bench", choices=("tiny", "bench"),
                    help="size of the default checkpoint (bench: its model work, not the load client, sets the "
                         "capacity; at tiny the stack outruns what one client process on these cores can send)")
    ap.add_argument("--restarts", default="fork", choices=("fork", "standby"),
                    help="how a killed or added instance comes up: forked from the stack's fork server (no "
                         "imports), or a promoted standby process per stage process (imports done ahead, "
                         "each standby's own ~4 CPU-s spent beside the serving ones)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--profile", default=None, help="hasctl profile of the checkpoint (default: made once)")
    ap.add_argument("--tier", default="moderate", choices=("tight", "moderate", "loose"))
    ap.add_argument("--mult", type=float, default=2.0, help="load = this x the measured capacity")
    ap.add_argument("--probe-rate", type=float, default=6.0, help="arrival rate of the capacity probe")
    ap.add_argument("--probe-s", type=float, default=None,
                    help="length of each capacity probe (20 s; 10 s with --quick)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--deadline-s", type=float, default=30.0, help="each request's `timeout`")
    ap.add_argument("--window-s", type=float, default=5.0, help="goodput window of the recovery time")
    ap.add_argument("--out", default=str(ROOT / "runs" / "chaos" / "last.json"), help="per-request records")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes = 1.5
    if args.probe_s is None:
        args.probe_s = 10.0 if args.quick else 20.0
    return args


# ---- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    index: int
    at_s: float
    modality: str
    body: bytes
    stream: bool
    cancel_after: int = 0        # chunks after which the client closes the stream (0: never)
    malformed: bool = False


def _malform(body: dict, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return json.dumps(body).encode()[: rng.randrange(5, 40)]           # cut JSON
    if kind == 1:
        return json.dumps({**body, "max_tokens": -3}).encode()
    if kind == 2:
        return json.dumps({**body, "messages": "not a list"}).encode()
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAAAAAA"}}
    return json.dumps({**body, "messages": [{"role": "user", "content": [bad]}]}).encode()


def plan(rate: float, duration_s: float, seed: int, model: str, args, faults_mix: bool = True) -> list[Planned]:
    """Seeded arrivals and bodies; `faults_mix` False: every request well-formed and read to its end."""
    times = arrival_times(rate, 1.0, seed, duration_s=duration_s)
    spec = WorkloadSpec(modality="mixed", mix=("image", "video", "text"), image_size=(112, 112),
                        video_frames=4, video_size=(56, 56), input_tokens=16, output_tokens=args.max_tokens)
    rng, out = random.Random(seed), []
    for req, at in zip(synthesize(spec, len(times), seed), times):
        u, coin = rng.random(), rng.random()
        malformed, cancel = faults_mix and u < 0.05, faults_mix and 0.05 <= u < 0.15
        stream = cancel or coin < 0.6
        body = {**req.body(model, ignore_eos=True), "seed": req.index, "timeout": args.deadline_s, "stream": stream}
        if not stream:
            body.pop("stream_options")
        raw = _malform(body, rng) if malformed else json.dumps(body).encode()
        out.append(Planned(req.index, at, req.modality, raw, stream,
                           rng.randrange(1, args.max_tokens) if cancel else 0, malformed))
    return out


async def _one(session, url: str, p: Planned, rec: RequestRecord, clock) -> dict:
    import aiohttp

    res = {"index": p.index, "outcome": "", "detail": "", "text": "", "tokens": None}
    rec.sent_s = clock()
    try:
        async with session.post(url, data=p.body, headers={"Content-Type": "application/json"}) as resp:
            if p.malformed:
                res["outcome"] = "rejected_invalid" if resp.status == 400 else "malformed_not_400"
                res["detail"] = f"HTTP {resp.status}"
            elif resp.status != 200:
                res["outcome"] = RETRYABLE.get(resp.status, "lost")
                res["detail"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            elif p.stream:
                await _read_stream(resp, p, rec, res, clock)
            else:
                data = await resp.json()
                rec.chunk_s.append(clock())
                res["text"] = data["choices"][0]["message"]["content"] or ""
                res["tokens"] = rec.output_tokens = data["usage"]["completion_tokens"]
                res["outcome"] = "completed"
    except asyncio.TimeoutError:
        res["outcome"], res["detail"] = "hung", "no byte for deadline + 5 s"
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError, TypeError) as e:
        res["outcome"], res["detail"] = "lost", f"{type(e).__name__}: {e}"
    rec.end_s = clock()
    if res["outcome"] != "completed":
        rec.error, rec.error_kind = res["detail"] or res["outcome"], res["outcome"]
    return res


async def _read_stream(resp, p: Planned, rec: RequestRecord, res: dict, clock) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            res["outcome"] = "completed"
            return
        event = json.loads(data)
        if "error" in event:
            code = event["error"].get("code")
            res["outcome"], res["detail"] = RETRYABLE.get(code, "lost"), f"in-band {code}: {event['error']}"[:300]
            return
        for choice in event.get("choices") or ():
            if text := (choice.get("delta") or {}).get("content"):
                rec.chunk_s.append(clock())
                res["text"] += text
        if event.get("usage"):
            res["tokens"] = rec.output_tokens = event["usage"]["completion_tokens"]
        if p.cancel_after and len(rec.chunk_s) >= p.cancel_after:
            res["outcome"] = "cancelled"
            resp.close()  # the client goes away mid-stream: its connection closes
            return
    res["outcome"], res["detail"] = "lost", "the stream ended without [DONE]"


async def run_load(url: str, plans: list[Planned], deadline_s: float, t0: float) -> tuple[list[dict], list[RequestRecord]]:
    """Open loop: each request at t0 + its at_s, whatever the earlier ones are doing."""
    import aiohttp

    clock = lambda: time.monotonic() - t0  # noqa: E731
    recs = [RequestRecord(p.index, p.modality, p.at_s) for p in plans]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=deadline_s + 5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        tasks = []
        for p, rec in zip(plans, recs):
            await asyncio.sleep(max(0.0, p.at_s - clock()))
            tasks.append(asyncio.create_task(_one(session, url + "/v1/chat/completions", p, rec, clock)))
        return list(await asyncio.gather(*tasks)), recs


def capacity(results: list[dict], recs: list[RequestRecord]) -> float:
    """Completions per second of an overloaded run, first and last 15 % of finish times dropped."""
    ends = sorted(r.end_s for x, r in zip(results, recs) if x["outcome"] == "completed")
    k = int(len(ends) * 0.15)
    mid = ends[k: len(ends) - k]
    if len(mid) < 4 or mid[-1] <= mid[0]:
        raise RuntimeError(f"the capacity probe completed only {len(ends)} requests; raise --probe-s")
    return (len(mid) - 1) / (mid[-1] - mid[0])


def measure_capacity(url: str, model: str, args, log) -> float:
    """`capacity` of an open-loop probe from --probe-rate; the rate doubles (up to 5 times) while
    the stack completes more than 70 % of it, i.e. while the probe does not overload it. The best
    probe's figure (a probe far past capacity can complete nothing at all)."""
    rate, best = args.probe_rate, 0.0
    for attempt in range(6):
        plans = plan(rate, args.probe_s, args.seed + 2 + attempt, model, args, False)
        try:
            cap = capacity(*asyncio.run(run_load(url, plans, args.deadline_s, time.monotonic())))
        except RuntimeError as e:  # collapsed: nothing completed in the probe's middle
            cap = 0.0
            log(f"probe at {rate:.1f} req/s: {e}")
        best = max(best, cap)
        if cap < 0.7 * rate:
            break
        log(f"probe at {rate:.1f} req/s completed {cap:.2f} req/s: not overloaded, doubling")
        rate *= 2
    if not best:
        raise RuntimeError("no capacity probe completed enough requests; see the stage logs")
    return best


# ---- faults --------------------------------------------------------------------------------------
def _instances(stack, stage: str) -> list[str]:
    for _ in range(5):
        try:
            return [n for n in stack.pids if n.rpartition("-")[0] == stage]
        except RuntimeError:  # the launcher changed its process table meanwhile
            time.sleep(0.01)
    return []


def _signal(stack, name: str, sig: int) -> int:
    pid = stack.pids[name]
    os.killpg(pid, sig)
    return pid


def apply(stack, f: Fault, events: list) -> None:
    name = f.target(_instances(stack, f.stage))
    ev = {"at_s": f.at_s, "kind": f.kind, "target": name, "result": "ok"}
    events.append(ev)
    try:
        if f.kind == "link_cut":
            ev["result"] = LINK_CUT
        elif name is None:
            ev["result"] = "skipped: no instance running"
        elif f.kind == "kill":
            _signal(stack, name, signal.SIGKILL)
        elif f.kind == "stop":
            pid = _signal(stack, name, signal.SIGSTOP)
            time.sleep(f.hold_s)
            os.killpg(pid, signal.SIGCONT)
        elif f.kind == "drain":
            ev["result"] = f"exit code {stack.remove_instance(name)}; added {_add(stack, f.stage)}"
    except (ValueError, KeyError, ProcessLookupError, RuntimeError, TimeoutError) as e:
        ev["result"] = f"{type(e).__name__}: {e}"[:300]


def _add(stack, stage: str, tries: int = 3) -> str:
    """Scale back up: add an instance, again when a kill hits the new one while it starts."""
    for i in range(tries):
        try:
            return stack.add_instance(stage)
        except StageExited:
            if i == tries - 1:
                raise
    raise AssertionError("unreachable")


def inject(stack, faults: list[Fault], t0: float, events: list) -> tuple[threading.Thread, list[threading.Thread]]:
    """Start a thread that fires each fault at t0 + at_s (each in its own thread: a drain blocks)."""
    threads: list[threading.Thread] = []

    def loop() -> None:
        for f in faults:
            time.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
            t = threading.Thread(target=apply, args=(stack, f, events), daemon=True)
            t.start()
            threads.append(t)
    main = threading.Thread(target=loop, daemon=True)
    main.start()
    return main, threads


# ---- leaks ---------------------------------------------------------------------------------------
GAUGES = {"in_flight": ("easerve:num_requests_running", "easerve:num_requests_waiting", "easerve:prefill_queue_depth"),
          "kv_usage_perc": ("easerve:kv_cache_usage_perc",), "kv_sender_held_bytes": ("easerve:kv_sender_held_bytes",)}


def _gauges(url: str) -> dict[str, float]:
    out = dict.fromkeys(GAUGES, 0.0)
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
        for key, names in GAUGES.items():
            if name in names:
                out[key] += float(value)
    return out


def _established(port: int) -> int:
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            n += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return n


def _unheld_shm() -> int:
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            held.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
            held.update(line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/dev/shm/" in line)
        except OSError:
            continue
    return sum(f"/dev/shm/{n}" not in held for n in os.listdir("/dev/shm") if n.startswith("easerve"))


FD_READS = 4  # the fewest open fds of this many reads 0.5 s apart: a leak stays, the socket of a
              # /metrics read (just before) or a reconnecting peer does not


def _fd_kinds(pid: int) -> dict[str, int]:
    """A process's open fds by kind (socket, pipe, anon_inode:[eventfd], file...). Those on
    /dev/shm count apart: "/dev/shm" those on segments in use, "/dev/shm dead" those on an
    unlinked segment or on a slab whose owner is gone (`shm_reclaim`'s lock free): a receiver
    maps each live sender's slab once it first takes from it, so how many live ones a process
    holds follows which peers sent to it, and only the dead ones are a leak."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":[")[0] if ":[" in target and not target.startswith("anon_inode") else target
        if kind.startswith("/dev/shm/"):
            kind = "/dev/shm dead" if _dead_segment(kind) else "/dev/shm"
        elif kind.startswith("/"):
            kind = "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _dead_segment(path: str) -> bool:
    """An fd's /dev/shm target that is unlinked, or an owned slab nobody holds the owner's lock of."""
    from easerve.transport.shm_reclaim import owner_alive
    if path.endswith(" (deleted)"):
        return True
    return path.endswith("-owned") and not owner_alive(path)


def _stage_fds(stack) -> dict[str, dict[str, int]]:
    """Each stage process's (gateway excluded) open fds by kind."""
    out = {}
    for name, pid in stack.pids.items():
        if name != "gateway" and pid:
            try:
                out[name] = _fd_kinds(pid)
            except FileNotFoundError:
                pass
    return out


def snapshot(stack) -> dict:
    out = dict.fromkeys(GAUGES, 0.0)
    for url in stack.endpoints.metrics.values():
        for k, v in _gauges(url).items():
            out[k] += v
    reads = [_stage_fds(stack)]
    for _ in range(FD_READS - 1):
        time.sleep(0.5)
        reads.append(_stage_fds(stack))
    fewest = min(reads, key=lambda r: sum(sum(k.values()) for k in r.values()))
    gw_port = int(stack.endpoints.http.rsplit(":", 1)[1])
    return {**out, "open_streams": _established(gw_port), "shm_segments_unheld": _unheld_shm(),
            "shm_dead_held": sum(k.get("/dev/shm dead", 0) for k in fewest.values()),
            "fds": sum(n for k in fewest.values() for kind, n in k.items() if not kind.startswith("/dev/shm")),
            "fds_by_process": fewest}


def fd_growth(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per process, the fd kinds whose count changed from `before` to `after` (where a leak lives)."""
    out = {}
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, {}), after.get(name, {})
        diff = {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}
        if diff:
            out[name] = diff
    return out


# ---- scoring -------------------------------------------------------------------------------------
def counts(results: list[dict]) -> dict:
    c = {k: 0 for k in OUTCOMES}
    for r in results:
        c[r["outcome"]] += 1
    return {"sent": len(results), **c}


def token_mismatches(clean: list[dict], faulty: list[dict]) -> tuple[int, int]:
    ref = {r["index"]: r for r in clean if r["outcome"] == "completed"}
    both = [(ref[r["index"]], r) for r in faulty if r["outcome"] == "completed" and r["index"] in ref]
    return sum((a["text"], a["tokens"]) != (b["text"], b["tokens"]) for a, b in both), len(both)


# ---- the flow ------------------------------------------------------------------------------------
def start_stack(model: str, profile: str, tier: str, admission: str = "reject", restarts: str = "fork"):
    from hasctl.deployment import Deployment, Worker
    from hasctl.launch import Stack
    one = {"threads": 1}
    d = Deployment(model=model, name="chaos",
                   encode=(Worker(flags={"max-batch": 8, "remote-fraction": 1.0, **one}),) * 2,
                   prefill=(Worker(flags=one),) * 2, decode=(Worker(flags=one),) * 2)
    d = d.with_gateway_ports(0, 0).with_flags("gateway", profile=profile, admission=admission, slo_tier=tier)
    return Stack(d, standby=restarts == "standby", fork=restarts == "fork", metrics=True,
                 env={"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}).start(timeout=900)


def unloaded(url: str, model: str, args, repeats: int = 4) -> dict[str, tuple[float, float]]:
    """Per modality, the median (TTFT s, TPOT s) of streamed requests sent one at a time through
    the stack (the first of each modality left out: a warm-up)."""
    out = {}
    for modality in MODALITIES:
        reqs = [p for p in plan(5.0, 60.0, args.seed + 7, model, args, False) if p.modality == modality]
        got = []
        for p in reqs[: repeats + 1]:
            body = {**json.loads(p.body), "stream": True, "stream_options": {"include_usage": True}}
            res, recs = asyncio.run(run_load(url, [Planned(p.index, 0.0, modality, json.dumps(body).encode(), True)],
                                             args.deadline_s, time.monotonic()))
            if res[0]["outcome"] != "completed" or recs[0].tpot_s is None:
                raise RuntimeError(f"an unloaded {modality} request did not complete: {res[0]['detail']}")
            got.append((recs[0].ttft_s, recs[0].tpot_s))
        got = got[1:]
        out[modality] = (float(np.median([g[0] for g in got])), float(np.median([g[1] for g in got])))
    return out


def stack_tiers(profile_path: str, measured: dict[str, tuple[float, float]], out_path: Path) -> str:
    """A copy of the profile whose SLO tiers are the default multiples of the stack's own unloaded
    latency (`unloaded`), not of the model's in-process latency: on the tiny checkpoint the stack's
    hops are most of a request's time, so a tier of the model alone is one no request meets."""
    import dataclasses as dc
    from easerve import profile_format as pf
    prof = pf.load(profile_path)
    base = {u.modality: u for u in prof.unloaded}
    rows = [dc.replace(base[m], ttft_s=t, tpot_s=p) if m in base else
            pf.Unloaded(m, "", 16, 12, t, p) for m, (t, p) in measured.items()]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pf.dump(dc.replace(prof, tiers=pf.tiers_from(rows)), out_path)
    return str(out_path)


def settle(stack, timeout_s: float = 60.0) -> dict:
    """Wait until every process is SERVING and the in-flight gauges read 0 (or timeout_s); a snapshot."""
    stack.wait_healthy(timeout_s * 2)
    deadline = time.monotonic() + timeout_s
    while (snap := snapshot(stack))["in_flight"] > 0 and time.monotonic() < deadline:
        time.sleep(1.0)
    return snap


LEAK_RECHECKS, LEAK_RECHECK_S = 5, 2.0


def leaked(before: dict, after: dict) -> list[str]:
    """The resources of `leak_detail` higher after than before."""
    return [k for k in before if k != "fds_by_process" and after[k] > before[k]]


def settle_after(stack, before: dict) -> dict:
    """`settle`, then while anything reads higher than `before`, up to LEAK_RECHECKS more
    snapshots LEAK_RECHECK_S apart: a process restarted at the run's last second may still be
    reconnecting, a receiver lets go of a dead sender's slab within a second or two
    (easerve/transport/shm.py TIDY_S); a leak stays."""
    after = settle(stack)
    for _ in range(LEAK_RECHECKS):
        if not leaked(before, after):
            break
        time.sleep(LEAK_RECHECK_S)
        after = snapshot(stack)
    return after


def main(argv=None) -> int:
    args = parse_args(argv)
    from easerve import profile_format
    from easerve.models.tiny import cached_tiny
    model = args.model or str(cached_tiny("qwen2.5-vl", args.cache_dir, scale=args.scale))
    profile = profile_of(SimpleNamespace(profile=args.profile, quick=True), model)
    duration = args.minutes * 60.0
    log = lambda msg: print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    name = Path(model).name
    probe_stack = start_stack(model, profile, args.tier, admission="off", restarts=args.restarts)
    try:  # capacity and the unloaded latency, with admission off: what the stack itself can do
        url = probe_stack.endpoints.http
        asyncio.run(run_load(url, plan(1.0, 3.0, args.seed + 1, name, args, False), args.deadline_s, time.monotonic()))
        alone = unloaded(url, name, args)
        cap = measure_capacity(url, name, args, log)
    finally:
        probe_stack.stop(grace_s=5.0)
    profile = stack_tiers(profile, alone, Path(args.out).with_suffix(".profile.json"))
    slo = profile_format.load(profile).slo(args.tier)
    log("unloaded through the stack (TTFT, TPOT ms): " + ", ".join(
        f"{m} {t * 1e3:.0f} / {p * 1e3:.1f}" for m, (t, p) in alone.items()) + f"; SLO {args.tier}: {slo.to_dict()}")
    stack = start_stack(model, profile, args.tier, restarts=args.restarts)
    try:
        url = stack.endpoints.http
        log(f"stack up in {stack.run_dir}")
        asyncio.run(run_load(url, plan(1.0, 3.0, args.seed + 1, name, args, False), args.deadline_s, time.monotonic()))
        rate = args.mult * cap
        log(f"capacity {cap:.2f} req/s; runs at {rate:.2f} req/s for {duration:.0f} s")
        plans = plan(rate, duration, args.seed, name, args)
        settle(stack)
        with CpuLedger(stack) as cpu_clean:
            clean, clean_recs = asyncio.run(run_load(url, plans, args.deadline_s, time.monotonic()))
        log(f"clean run: {counts(clean)}")
        before = settle(stack)
        faults, events = schedule(duration, args.seed), []
        t0 = time.monotonic() + 0.5
        with CpuLedger(stack) as cpu_faults:
            main_thread, fired = inject(stack, faults, t0, events)
            faulty, faulty_recs = asyncio.run(run_load(url, plans, args.deadline_s, t0))
            main_thread.join()
            for t in fired:
                t.join()
        after = settle_after(stack, before)
        log(f"fault run: {counts(faulty)}")
    finally:
        stack.stop(grace_s=5.0)
    wanted = [r for p, r in zip(plans, clean_recs) if not p.malformed and not p.cancel_after]
    good_clean = sum(slo.met(r) for r in wanted)
    good_faults = sum(slo.met(r) for p, r in zip(plans, faulty_recs) if not p.malformed and not p.cancel_after)
    kills = [f.at_s for f in faults if f.kind == "kill"]
    good = {name: good_per_s([r.end_s for p, r in zip(plans, recs) if not p.cancel_after and slo.met(r)], duration)
            for name, recs in (("clean", clean_recs), ("faults", faulty_recs))}
    target = good_clean / duration
    rec_s = recovery_s(window_mean(good["faults"], int(args.window_s)), target, kills)
    rec_clean = recovery_s(window_mean(good["clean"], int(args.window_s)), target, kills)  # no fault: the floor
    others = [f.at_s for f in faults if f.kind in ("stop", "drain")]
    lone = isolated(kills, others, before_s=5.0, after_s=10.0)
    epochs = {"all": epoch_recovery(good["faults"], good["clean"], kills, seed=args.seed),
              "isolated": epoch_recovery(good["faults"], good["clean"], lone, seed=args.seed)}
    mism, checked = token_mismatches(clean, faulty)
    leak_detail = {k: [before[k], after[k]] for k in before if k != "fds_by_process"}
    cpu_c, cpu_f = cpu_clean.summary(), cpu_faults.summary()
    c = counts(faulty)
    out = {**{k: c[k] for k in ("sent", "completed", "refused_retryable", "failed_retryable", "lost", "hung")},
           "duplicated_or_missing_tokens": mism,
           "goodput_faults_over_clean": round(good_faults / good_clean, 3) if good_clean else None,
           "recovery_s_p99": round(float(np.percentile(rec_s, 99)), 2) if rec_s else None,
           "recovery_s": [round(x, 1) for x in rec_s],
           "recovery_s_clean_p99": round(float(np.percentile(rec_clean, 99)), 2) if rec_clean else None,
           "recovery_s_epoch": epochs["all"].get("recovered_s"),
           "recovery_s_epoch_ci95": epochs["all"].get("recovered_s_ci95"),
           "recovery_s_epoch_isolated": epochs["isolated"].get("recovered_s"),
           "recovery_epoch": epochs,
           "leaks": len(leaked(before, after)),
           "fd_growth": fd_growth(before["fds_by_process"], after["fds_by_process"]),
           "cancelled": c["cancelled"], "rejected_invalid": c["rejected_invalid"],
           "malformed_not_400": c["malformed_not_400"], "tokens_checked": checked,
           "lost_details": sorted({r["detail"][:120] for r in faulty if r["outcome"] in ("lost", "hung")})[:10],
           "clean": counts(clean), "capacity_rps": round(cap, 3), "rate_rps": round(rate, 3), "minutes": args.minutes,
           "seed": args.seed, "slo": slo.to_dict(), "slo_from": SLO_FROM,
           "unloaded_ms": {m: [round(t * 1e3, 1), round(p * 1e3, 2)] for m, (t, p) in alone.items()},
           "modalities": list(MODALITIES),
           "faults": {k: sum(e["kind"] == k for e in events) for k in ("kill", "stop", "drain")},
           "fault_errors": [e for e in events if e["result"] != "ok" and not e["result"].startswith("exit code 0")
                            and e["kind"] != "link_cut"][:10],
           "link_cut": LINK_CUT, "leak_detail": leak_detail, "restarts": stack.restarts, "restart_mode": args.restarts,
           "cpu_clean": cpu_c, "cpu_faults": cpu_f,
           "serving_cpu_faults_over_clean": round(cpu_f["serving_cpu_s"] / cpu_c["serving_cpu_s"], 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**out, "events": events, "clean_results": clean, "fault_results": faulty,
                                          "good_per_s": {k: v.tolist() for k, v in good.items()},
                                          "records": {"clean": [r.to_dict() for r in clean_recs],
                                                      "faults": [r.to_dict() for r in faulty_recs]}},
                                         indent=1) + "\n")
    finish("chaos", args, out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
