"""kill -9 of each stage under steady load, on a live multi-process stack (the launcher
supervises it): every request ends, completed or with 503 within its deadline; the
launcher restarts the stage; goodput per 5 s window is back to >= 90 % of the pre-kill
windows within 30 s; sent == completed + errored, counted here, on the client side.

Scenarios: encode, remote prefill and decode of the `default` layout, and the encode
process of the `colocated` layout (it runs prefill itself for part of the requests), each
with one and with two instances per stage. Every request carries an image, so each one
passes through encode, a prefill and a decode. Figures: docs/reliability/faults.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
import zlib
from pathlib import Path

import grpc
import pytest

from easerve.client_request import build_request
from easerve.models.tiny import cached_tiny
from easerve.wire.v1 import gateway_pb2_grpc
from hasctl.deployment import preset
from hasctl.launch import Stack
from tests.reliability.driver import HUNG, LoadDriver, image_bodies, recovery_s, served_model
from tests.support.procs import gone

pytestmark = [pytest.mark.slow, pytest.mark.load]

RATE = 3.0           # requests/s offered, well under what the stack serves on 2 cores
DEADLINE_S = 10.0    # each request's own deadline (its `timeout`)
WARM_S, BASE_S, AFTER_S = 4.0, 10.0, 32.0   # warm-up, two pre-kill windows, after the kill
WINDOW_S, RECOVERY_BOUND_S = 5.0, 30.0
STANDBY = os.environ.get("EASERVE_FAULT_STANDBY", "1") != "0"  # restart from a pre-imported standby
GRPC_STREAMS = 3    # long gRPC streams open at the kill (UNAVAILABLE or OK, never a hang)
FIGURES = os.environ.get("EASERVE_FAULT_FIGURES")  # append one JSON line per scenario here

SCENARIOS = [(layout, n, stage) for n in (1, 2)
             for layout, stage in (("default", "encode"), ("default", "prefill"), ("default", "decode"),
                                   ("colocated", "encode"))]


def deployment(model: str, layout: str, n: int):
    d = preset(layout).with_model(model).with_gateway_ports(0, 0)
    d = dataclasses.replace(d, **{s: getattr(d, s) * n for s in ("encode", "prefill", "decode")})
    return (d.with_flags("decode", max_seq_len=1024, threads=1).with_flags("prefill", threads=1)
            .with_flags("encode", threads=1))


class _Stacks:
    """One live stack at a time, reused by consecutive scenarios of the same shape."""

    def __init__(self, model: str):
        self.model, self.key, self.stack = model, None, None

    def get(self, layout: str, n: int) -> Stack:
        if self.key != (layout, n):
            self.close()
            self.stack = Stack(deployment(self.model, layout, n), env={"EASERVE_LOG_LEVEL": "WARNING"},
                               standby=STANDBY)
            self.stack.start(timeout=420)
            self.key = (layout, n)
        return self.stack

    def close(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        self.key = self.stack = None


@pytest.fixture(scope="module")
def stacks(tiny_root):
    s = _Stacks(str(cached_tiny("qwen2.5-vl", tiny_root)))
    yield s
    s.close()


async def _kill_under_load(stack: Stack, name: str) -> dict:
    url = stack.endpoints.http
    total = WARM_S + BASE_S + AFTER_S
    bodies = image_bodies(await served_model(url), int(RATE * total) + 1, seed=zlib.crc32(name.encode()) & 0xFFFF)
    async with LoadDriver(url, bodies, deadline_s=DEADLINE_S) as drv:
        load = asyncio.ensure_future(drv.run(RATE, total))
        await asyncio.sleep(WARM_S + BASE_S)
        streams = [asyncio.ensure_future(_grpc_stream(stack.endpoints.grpc, i)) for i in range(GRPC_STREAMS)]
        await asyncio.sleep(0.5)  # the gRPC streams are past their first token
        restarts, pid = stack.restarts[name], stack.pids[name]
        kill_s = drv.clock()
        os.kill(pid, signal.SIGKILL)
        await load
        grpc_out = await asyncio.gather(*streams)
    series = drv.goodput(WINDOW_S, since_s=kill_s - BASE_S, until_s=kill_s + AFTER_S)
    n_pre = round(BASE_S / WINDOW_S)
    pre = [g for _, g in series[:n_pre]]  # the windows before the kill
    # at most the offered rate: a fresh stack's slow first requests end in the first window
    # (backlog), which would otherwise set a bar no steady state at RATE can reach
    baseline = min(sum(pre) / len(pre), RATE)
    return {"drv": drv, "kill_s": kill_s, "series": series, "baseline": baseline,
            "recovery_s": recovery_s(series, n_pre, baseline), "grpc": grpc_out, "restarted": stack.restarts[name] > restarts,
            "new_pid": stack.pids[name] != pid}


async def _grpc_stream(addr: str, i: int) -> tuple[str, float]:
    """(status code name, seconds) of one long streamed gRPC request (in flight at the kill)."""
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(addr) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            build_request(f"stream {i}", max_tokens=300, ignore_eos=True), timeout=DEADLINE_S)
        try:
            async for _ in call:
                pass
            return "OK", time.monotonic() - t0
        except grpc.aio.AioRpcError as e:
            return e.code().name, time.monotonic() - t0


def test_killed_process_group_leaves_no_slab_after_the_restart(stacks):
    """kill -9 of prefill's whole process group (its resource tracker too) leaves its 256 MiB
    slab in /dev/shm; the launcher's restart unlinks it."""
    stack = stacks.get("default", 1)
    stack.wait_healthy(120)
    asyncio.run(_some_requests(stack.endpoints.http, 3))  # prefill has sent KV: its slab exists
    pid = stack.pids["prefill-0"]
    slabs = _slabs_owned_by(pid)
    assert slabs, "prefill-0 owns no shm slab (is the KV transport shm?)"
    young = max(os.stat(s).st_ctime for s in slabs) + 11 - time.time()
    time.sleep(max(0.0, young))  # past reclaim_stale's min_age_s: only the owner's lock protects it
    restarts = stack.restarts["prefill-0"]
    os.killpg(pid, signal.SIGKILL)
    end = time.monotonic() + 60
    while stack.restarts["prefill-0"] == restarts:
        assert time.monotonic() < end, "prefill-0 was not restarted"
        time.sleep(0.1)
    left = [s for s in slabs if Path(s).exists()]
    assert not left, f"the dead prefill's slab is still in /dev/shm after the restart: {left}"
    stack.wait_healthy(120)
    asyncio.run(_some_requests(stack.endpoints.http, 2))


async def _some_requests(url: str, n: int) -> None:
    async with LoadDriver(url, image_bodies(await served_model(url), n, seed=5), deadline_s=30) as drv:
        for _ in range(n):
            drv.send()
    assert drv.tally().completed == n, drv.tally()


def _slabs_owned_by(pid: int) -> list[str]:
    """The slabs `pid` maps and holds the owner's flock on: it also maps slabs other stages own
    (encode's embedding slab, read over the same transport), which must outlive its death."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/dev/shm/" in line}
    slabs = [p for p in paths if p.endswith("-owned") and "-slab-" in p]
    with open("/proc/locks") as f:  # "1: FLOCK  ADVISORY  WRITE <pid> <maj>:<min>:<inode> 0 EOF"
        locked = {int(parts[5].rsplit(":", 1)[1]) for parts in (line.split() for line in f)
                  if len(parts) > 5 and parts[1] == "FLOCK" and parts[4] == str(pid)}
    return sorted(p for p in slabs if os.stat(p).st_ino in locked)


@pytest.mark.parametrize("layout,n,stage", SCENARIOS, ids=[f"{l}-x{n}-kill-{s}" for l, n, s in SCENARIOS])
def test_kill_stage_under_load(stacks, layout, n, stage):
    stack = stacks.get(layout, n)
    stack.wait_healthy(120)  # the previous scenario's restarted stage is back
    name = f"{stage}-0"
    end = time.monotonic() + 180
    while STANDBY and not stack.standby_ready(name):
        assert time.monotonic() < end, f"{name}'s standby did not finish its imports in 180 s"
        time.sleep(0.5)
    r = asyncio.run(_kill_under_load(stack, name))
    drv, kill_s, tally = r["drv"], r["kill_s"], r["drv"].tally()
    in_flight = [o for o in drv.outcomes if o.sent_s < kill_s < o.end_s]
    _record(layout, n, stage, r, tally, in_flight)
    # nothing lost, nothing hung, every error a clear 503 / 504 within the deadline
    assert tally.sent == tally.completed + tally.errored == len(drv.outcomes), tally
    assert tally.by_status.get(HUNG, 0) == 0, tally
    bad = [o for o in drv.outcomes if o.status not in (200, 503)]
    assert not bad, f"{len(bad)} requests ended otherwise than 200 / 503: {[(o.status, o.detail) for o in bad[:5]]}"
    late = [o for o in drv.outcomes if o.status == 503 and o.latency_s > DEADLINE_S + 1.0]
    assert not late, f"503s past the {DEADLINE_S} s deadline: {[round(o.latency_s, 1) for o in late[:5]]}"
    assert all(o.retry_after for o in drv.outcomes if o.status == 503), "a 503 without Retry-After"
    assert {c for c, _ in r["grpc"]} <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, r["grpc"]
    assert all(dt <= DEADLINE_S + 1.0 for _, dt in r["grpc"]), r["grpc"]
    # the launcher restarted it, and goodput came back
    assert r["restarted"] and r["new_pid"], f"{name} was not restarted: {stack.restarts}"
    if STANDBY:
        starts = [ln for ln in stack.log_tail(name, 200).splitlines() if ln.startswith("=== ") and " start #" in ln]
        assert "promoted" in starts[-1], f"{name} was restarted cold, not from its standby: {starts[-1]}"
    assert r["baseline"] >= 0.8 * RATE, f"the stack did not keep up before the kill: {r['series']}"
    assert r["recovery_s"] is not None and r["recovery_s"] <= RECOVERY_BOUND_S, \
        f"goodput not back to 90 % of {r['baseline']:.2f}/s within {RECOVERY_BOUND_S} s: {r['series']}"


def _record(layout, n, stage, r, tally, in_flight) -> None:
    line = {"layout": layout, "instances": n, "killed": stage, "standby": STANDBY, "rate": RATE, "deadline_s": DEADLINE_S,
            "sent": tally.sent, "completed": tally.completed, "errored": tally.errored,
            "by_status": {str(k): v for k, v in tally.by_status.items()},
            "in_flight_at_kill": len(in_flight),
            "grpc_streams_at_kill": sorted(c for c, _ in r["grpc"]),
            "in_flight_outcomes": dict(sorted({str(o.status): sum(p.status == o.status for p in in_flight)
                                               for o in in_flight}.items())),
            "max_error_latency_s": round(max((o.latency_s for o in r["drv"].outcomes if o.status != 200),
                                             default=0.0), 2),
            "baseline_goodput": round(r["baseline"], 2), "recovery_s": r["recovery_s"],
            "goodput_series": [[round(t - r["kill_s"], 1), g] for t, g in r["series"]]}
    print("FAULT", json.dumps(line))
    if FIGURES:
        with Path(FIGURES).open("a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.mark.skipif(not STANDBY, reason="EASERVE_FAULT_STANDBY=0: no standbys")
def test_stop_leaves_no_process_and_no_standby_behind(stacks):
    stack = stacks.get("colocated", 2)
    end = time.monotonic() + 120
    while not all(stack.standby_ready(n) for n in stack.pids):
        assert time.monotonic() < end, "the launcher started no standby for some stage"
        time.sleep(0.2)
    pids = [p for p in stack.pids.values() if p] + [p.spare.pid for p in stack._procs.values() if p.spare]
    stacks.close()
    left = [pid for pid in pids if not gone(pid)]
    assert not left, f"processes left after stop(): {left}"
