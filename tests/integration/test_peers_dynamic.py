"""Peers that come and go, live: under a steady client load, the launcher adds a second prefill
instance (its callers, the gateway and encode, start sending to it without a restart), then
drains and removes the first (they stop sending to it, its open calls finish, it exits).
No request fails, and the removed process leaves no port behind."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.support.prom import metric, scrape
from tests.support.procs import gone
from tests.support.fake_stage import write_fake_python  # stages that only serve grpc health
from tests.support.client_load import ClientLoad

pytestmark = pytest.mark.slow
ONE = {"threads": 1}


def _prefilled(metrics_port: int) -> float:
    """Requests the prefill instance has prefilled (its /metrics)."""
    return metric(scrape(f"http://127.0.0.1:{metrics_port}/metrics"), "easerve:prefill_batch_size_count")


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _cycle(stack: Stack, load: ClientLoad, old: str, metrics: dict[str, int], notice_s: float) -> str:
    """Add a prefill instance, see it take requests, then drain and remove `old`; returns the
    added instance's name."""
    port = free_port()
    added = stack.add_instance("prefill", Worker(flags={"metrics-listen": f"127.0.0.1:{port}", **ONE}))
    metrics[added] = port
    new_addr, old_addr = stack.endpoints.stages[added], stack.endpoints.stages[old]
    for caller in ("gateway", "encode-0"):  # the gateway (text) and encode (images) list it
        listed = json.loads((stack.run_dir / f"{caller}.peers.json").read_text())["prefill"]
        assert listed == [old_addr, new_addr], caller
    load.wait(lambda: _prefilled(port) >= 4, 120, f"requests at the added {added}")

    old_port, old_pid = stack.ports[old], stack.pids[old]
    assert stack.remove_instance(old, notice_s=notice_s) == 0  # it drained and exited by itself
    assert gone(old_pid) and _refused(old_port) and _refused(metrics[old])
    assert old not in stack.endpoints.stages
    ok_then, images_then, at_new = load.ok, load.images_ok, _prefilled(port)
    load.wait(lambda: load.ok >= ok_then + 6 and load.images_ok > images_then, 180,
              f"requests after removing {old}, an image among them")
    assert _prefilled(port) >= at_new + 6  # what came since went to the instance that is left
    for caller in ("gateway", "encode-0"):
        assert json.loads((stack.run_dir / f"{caller}.peers.json").read_text())["prefill"] == [new_addr]
        log = stack.log_tail(caller, 10_000)
        assert f"easerve.v1.Prefill instance {new_addr} added" in log, caller
        assert f"easerve.v1.Prefill instance {old_addr} removed" in log, caller
        assert f"closed the channel to {old_addr}" in log, caller
    return added


@pytest.mark.load  # ~1 min; the decode drain test below keeps the same path in the main suite
def test_a_prefill_instance_added_then_drained_and_removed_under_load_fails_no_request(tiny_root):
    """Twice: first with the launcher's notice (callers stop sending before the drain), then
    with none (calls that reach the draining instance are refused and placed on the other)."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    metrics = {"prefill-0": free_port()}
    d = Deployment(model=model, name="peers-dynamic",
                   encode=(Worker(flags={"max-batch": 2, **ONE}),),
                   prefill=(Worker(flags={"metrics-listen": f"127.0.0.1:{metrics['prefill-0']}", **ONE}),),
                   decode=(Worker(flags={"num-slots": 8, **ONE}),)).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "INFO"})
    stack.start(timeout=420)
    try:
        with ClientLoad(stack.endpoints.grpc) as load:
            load.wait(lambda: load.ok >= 4, 120, "the first requests")
            assert _prefilled(metrics["prefill-0"]) >= 4
            first = _cycle(stack, load, "prefill-0", metrics, notice_s=1.0)
            assert first == "prefill-1"
            assert _cycle(stack, load, first, metrics, notice_s=0.0) == "prefill-2"
        assert load.errors == [], load.errors
        assert load.sent == load.ok and load.ok >= 28, (load.sent, load.ok)
        assert stack.restarts == {n: 0 for n in stack.restarts}
    finally:
        stack.stop()


def test_the_last_instance_of_a_stage_is_not_removed_and_unknown_names_are_refused(tmp_path):
    fake = write_fake_python(tmp_path / "fake-python")
    d = Deployment(model="/no/model/needed").with_gateway_ports(0, 0)
    stack = Stack(d, run_dir=tmp_path / "run", python=fake, env={"FAKE_KIDS": str(tmp_path / "kids")})
    stack.start(timeout=60)
    try:
        with pytest.raises(ValueError, match="prefill-0 is the last prefill instance; add another one first"):
            stack.remove_instance("prefill-0")
        with pytest.raises(ValueError, match="no removable instance 'prefill-7'"):
            stack.remove_instance("prefill-7")
        with pytest.raises(ValueError, match="stage must be one of"):
            stack.add_instance("gateway")
        name = stack.add_instance("prefill")
        assert name == "prefill-1" and stack.healthy(name)
        assert "--peers-file" in stack._procs["gateway"].cmd.argv
        assert stack.remove_instance("prefill-0", notice_s=0.0) == 0
        gw = json.loads((stack.run_dir / "gateway.peers.json").read_text())
        assert gw["prefill"] == [stack.endpoints.stages["prefill-1"]]
        assert gw["decode"] == [stack.endpoints.stages["decode-0"]] and gw["encode"] == []
        pre = json.loads((stack.run_dir / "prefill-1.peers.json").read_text())
        assert pre == {"decode": [stack.endpoints.stages["decode-0"]]}
    finally:
        stack.stop()


def test_a_decode_instance_drained_and_removed_under_load_fails_no_request(tiny_root):
    """Removing a decode instance mid-load (SIGTERM at once, no notice): the reservations it
    already holds still get their KV and finish; new ones go to the other instance."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    d = Deployment(model=model, name="decode-removed",
                   encode=(Worker(flags={"max-batch": 2, **ONE}),), prefill=(Worker(flags=ONE),),
                   decode=(Worker(flags={"num-slots": 8, **ONE}), Worker(flags={"num-slots": 8, **ONE})),
                   ).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "INFO"})
    stack.start(timeout=420)
    try:
        with ClientLoad(stack.endpoints.grpc, workers=4, max_tokens=24, all_images=True) as load:
            load.wait(lambda: load.ok >= 8, 180, "the first requests")
            old_port, old_pid = stack.ports["decode-0"], stack.pids["decode-0"]
            assert stack.remove_instance("decode-0", notice_s=0.0) == 0  # drained and exited by itself
            assert gone(old_pid) and _refused(old_port)
            ok_then, images_then = load.ok, load.images_ok
            load.wait(lambda: load.ok >= ok_then + 8 and load.images_ok > images_then, 180,
                      "requests after removing decode-0, an image among them")
        assert load.errors == [], load.errors
        log = (stack.run_dir / "decode-0.log").read_text()
        assert "settled: the work accepted before the drain is done" in log, log[-3000:]
    finally:
        stack.stop()
