"""`Stack(fork=True)`: every stage process, each restart after a kill -9 and each added instance
is forked from the fork server (`hasctl.forked`) that did the imports once; the forked
processes answer exactly what they answered before the kills; a drained one exits 0; stop()
leaves no process behind, the fork server included. Two instances of each stage."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import pytest

from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack
from tests.reliability.driver import image_bodies, served_model
from tests.support.procs import gone

pytestmark = [pytest.mark.slow]


def answers(stack: Stack, bodies: list[dict]) -> list[str]:
    out = []
    for body in bodies:
        req = urllib.request.Request(stack.endpoints.http + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read())["choices"][0]["message"]["content"])
    return out


def starts(stack: Stack, name: str) -> list[str]:
    return [ln for ln in stack.log_tail(name, 400).splitlines() if ln.startswith("=== ") and " start #" in ln]


def test_forked_stack_restarts_adds_and_drains_forked_processes(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    one = {"threads": 1}
    d = Deployment(model=model, name="forked", encode=(Worker(flags=one),) * 2,
                   prefill=(Worker(flags=one),) * 2, decode=(Worker(flags=one),) * 2).with_gateway_ports(0, 0)
    stack = Stack(d, fork=True, env={"EASERVE_LOG_LEVEL": "WARNING"}).start(timeout=420)
    pids = []
    try:
        assert all("(forked)" in starts(stack, n)[0] for n in stack.pids), {n: starts(stack, n) for n in stack.pids}
        bodies = image_bodies(asyncio.run(served_model(stack.endpoints.http)), 4)
        before = answers(stack, bodies)
        for name in ("prefill-0", "decode-1", "encode-0"):
            old = stack._procs[name].popen
            pids.append(old.pid)
            os.killpg(old.pid, signal.SIGKILL)
            assert old.wait(timeout=30) == -signal.SIGKILL  # the exit as the fork server reaped it
            end = time.monotonic() + 120
            while stack.pids[name] == old.pid or not stack.healthy(name):
                assert time.monotonic() < end, f"{name} not back in 120 s: {stack.log_tail(name)}"
                time.sleep(0.1)
            assert stack.restarts[name] == 1 and "(forked)" in starts(stack, name)[-1], starts(stack, name)
        added = stack.add_instance("prefill")
        assert "(forked)" in starts(stack, added)[0]
        pids += [p for p in stack.pids.values() if p]
        assert stack.remove_instance("prefill-1") == 0  # drained: SIGTERM, every call finished, exit 0
        assert answers(stack, bodies) == before
        server = stack._forks._proc.pid
    finally:
        stack.stop()
    left = [pid for pid in [*pids, server] if not gone(pid)]
    assert not left, f"processes left after stop(): {left}"
