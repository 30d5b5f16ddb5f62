"""A drain that drains: a prefill instance whose queue is longer than its grace time (its queue
depth times its mean prefill time, from its /metrics, several times --grace-s) is removed under
load (SIGTERM at once, no notice to its callers). Every request completes: the calls it
had accepted finish there however long its queue, the calls that reach it meanwhile are
refused UNAVAILABLE and placed on the other instance, and the process exits by itself.

The queue is built on purpose, not left to the gateway's balance: the stack starts with
prefill-0 alone under a closed loop of CLIENTS callers (so every request waits there), then
prefill-1 is added, and prefill-0 is removed once prefill-1 has served (the gateway knows it)
while prefill-0 still holds a queue of at least QUEUED calls."""
from __future__ import annotations

import re
import threading
import time

import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.support.prom import metric, scrape
from tests.support.procs import gone

pytestmark = pytest.mark.slow
GRACE_S = 0.2
CLIENTS = 40
QUEUED = 16  # prefill-0's queue when it is removed, at least


def _page(port: int) -> str:
    return scrape(f"http://127.0.0.1:{port}/metrics")


def _queue_s(port: int) -> float:
    """Seconds of work queued at a prefill instance (0 until QUEUED requests wait): its queue
    depth times its mean prefill time (batches of one)."""
    page = _page(port)
    depth, n = metric(page, "easerve:prefill_queue_depth"), metric(page, "easerve:prefill_batch_seconds_count")
    return depth * metric(page, "easerve:prefill_batch_seconds_sum") / n if depth >= QUEUED and n else 0.0


def _until(ok, what: str, errors: list[str], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < end and not errors, (errors, what)
        time.sleep(0.05)


def test_a_prefill_instance_whose_queue_outlasts_its_grace_is_removed_under_load_and_loses_nothing(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    port0, port1 = free_port(), free_port()
    slow = {"threads": 1, "grace-s": GRACE_S, "max-prefill-batch": 1, "metrics-listen": f"127.0.0.1:{port0}"}
    d = Deployment(model=model, name="drain", prefill=(Worker(flags=slow),),
                   decode=(Worker(flags={"num-slots": CLIENTS, "max-running": CLIENTS, "threads": 1}),),
                   ).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "INFO"})
    stack.start(timeout=300)
    client = Client(stack.endpoints.grpc, timeout=120)
    stop = threading.Event()
    done, errors, lock = [0] * CLIENTS, [], threading.Lock()

    def loop(i: int) -> None:  # a closed loop: the next request once the last one is answered
        k = 0
        while not stop.is_set():
            try:
                out = client.generate(f"request {i}.{k}: " + "tell me more about the numbers " * 45, max_tokens=2)
                assert len(out.token_ids) >= 1, out
            except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                with lock:
                    errors.append(f"request {i}.{k}: {e!r}")
                return
            done[i], k = done[i] + 1, k + 1
    try:
        client.generate("warm", max_tokens=1)
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        _until(lambda: _queue_s(port0) >= 3 * GRACE_S, "no queue at prefill-0 (alone)", errors)
        stack.add_instance("prefill", Worker(flags={"threads": 1, "metrics-listen": f"127.0.0.1:{port1}"}))
        _until(lambda: metric(_page(port1), "easerve:prefill_batch_seconds_count") > 0,
               "prefill-1 served nothing: the gateway did not take it up", errors)
        _until(lambda: _queue_s(port0) >= 3 * GRACE_S, "no queue at prefill-0 once prefill-1 served", errors)
        pid = stack.pids["prefill-0"]
        assert stack.remove_instance("prefill-0", notice_s=0.0) == 0  # drained, then exited by itself
        after = sum(done)
        _until(lambda: sum(done) >= after + CLIENTS, "no progress on prefill-1 alone", errors)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and not any(t.is_alive() for t in threads), errors
        assert gone(pid)
        log = (stack.run_dir / "prefill-0.log").read_text()
        accepted = re.search(r"draining: .* waiting for (\d+) accepted call", log)
        assert accepted and int(accepted[1]) >= QUEUED // 2, log[-3000:]  # a queue at SIGTERM...
        settled = re.search(r"settled: the work accepted before the drain is done \((\d+) call\(s\) answered", log)
        assert settled and int(settled[1]) >= int(accepted[1]), log[-3000:]  # ...all served there
    finally:
        stop.set()
        client.close()
        stack.stop()
