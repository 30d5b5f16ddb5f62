"""A drain that drains: a prefill instance whose queue is longer than its grace time (its queue
depth times its mean prefill time, from its /metrics, several times --grace-s) is removed under
load (SIGTERM at once, no notice to its callers). Every request completes: the calls it
had accepted finish there however long its queue, the calls that reach it meanwhile are
refused UNAVAILABLE and placed on the other instance, and the process exits by itself."""
from __future__ import annotations

import re
import threading
import time

import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.prom import metric, scrape
from tests.support.procs import gone

pytestmark = pytest.mark.slow
GRACE_S = 0.2
CLIENTS = 40
QUEUED = 16  # prefill-0's queue when it is removed


def _queue_s(port: int) -> float:
    """Seconds of work queued at a prefill instance (0 until QUEUED requests wait): its queue
    depth times its mean prefill time (batches of one)."""
    page = scrape(f"http://127.0.0.1:{port}/metrics")
    depth, n = metric(page, "easerve:prefill_queue_depth"), metric(page, "easerve:prefill_batch_seconds_count")
    return depth * metric(page, "easerve:prefill_batch_seconds_sum") / n if depth >= QUEUED and n else 0.0


def test_a_prefill_instance_whose_queue_outlasts_its_grace_is_removed_under_load_and_loses_nothing(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    mport = free_port()
    slow = {"threads": 1, "grace-s": GRACE_S, "max-prefill-batch": 1, "metrics-listen": f"127.0.0.1:{mport}"}
    d = Deployment(model=model, name="drain", prefill=(Worker(flags=slow), Worker(flags={"threads": 1})),
                   decode=(Worker(flags={"num-slots": CLIENTS, "max-running": CLIENTS, "threads": 1}),),
                   ).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "INFO"})
    stack.start(timeout=300)
    client = Client(stack.endpoints.grpc, timeout=120)
    done, errors, lock = [], [], threading.Lock()

    def one(i: int) -> None:
        try:
            out = client.generate(f"request {i}: " + "tell me more about the numbers " * 45, max_tokens=2)
            assert len(out.token_ids) >= 1, out
        except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
            with lock:
                errors.append(f"request {i}: {e!r}")
        else:
            with lock:
                done.append(i)
    try:
        client.generate("warm", max_tokens=1)
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        end = time.monotonic() + 60
        while _queue_s(mport) < 3 * GRACE_S:
            assert time.monotonic() < end and not errors, (errors, "no queue at prefill-0")
            time.sleep(0.05)
        pid = stack.pids["prefill-0"]
        assert stack.remove_instance("prefill-0", notice_s=0.0) == 0  # drained, then exited by itself
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and len(done) == CLIENTS, (errors, len(done))
        assert gone(pid)
        log = (stack.run_dir / "prefill-0.log").read_text()
        accepted = re.search(r"draining: .* waiting for (\d+) accepted call", log)
        assert accepted and int(accepted[1]) >= QUEUED // 2, log[-3000:]  # a queue at SIGTERM...
        assert "settled: the work accepted before the drain is done" in log, log[-3000:]  # ...all served
    finally:
        client.close()
        stack.stop()
