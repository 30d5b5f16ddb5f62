"""`--online` on the encode worker: the controller moves the live batcher and router, and the
changes and desired counts reach /metrics (easerve/stages/encode/online.py)."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig, Dispatch
from easerve.policy.clock import ManualClock
from easerve.policy.online import Knobs
from easerve.policy.router import DeficitRouter
from easerve.stages.common.configs import EncodeConfig
from easerve.stages.common.peers import Peers
from easerve.stages.encode.metrics import EncodeMetrics
from easerve.stages.encode.online import OnlineTask
from easerve.wire.v1 import prefill_pb2_grpc
from tests.support.prom import metric


def encode_cfg(**kw) -> EncodeConfig:
    return EncodeConfig(model="m", prefill=("127.0.0.1:1",), online=True, online_window_s=5.0, online_dwell_s=5.0, **kw)


def test_online_flags_build_the_controller_config_and_bad_bounds_name_the_flag():
    c = encode_cfg(online_batch="2:16", online_instances="1:3").online_config
    assert (c.bounds.min_batch, c.bounds.max_batch, c.bounds.max_instances) == (2, 16, 3)
    assert c.window_s == 5.0 and c.reversal_dwell_s == 20.0
    with pytest.raises(ValueError, match="--online-batch must be MIN:MAX"):
        encode_cfg(online_batch="8")
    with pytest.raises(ValueError, match="min_batch .* must be <= max_batch"):
        encode_cfg(online_batch="16:2")
    with pytest.raises(ValueError, match="hysteresis"):
        encode_cfg(online_util="0.8:0.7:0.9")
    assert encode_cfg(online_util="0.1:0.2:0.3").online_config.high_util == 0.3


def test_busy_encoder_gets_a_larger_b_logged_and_exported(caplog):
    cfg = encode_cfg(max_batch=4)
    clock = ManualClock()
    metrics = EncodeMetrics(1.0, clock=clock)
    batcher = AdaptiveBatcher(cfg.batcher)
    remote = Peers(prefill_pb2_grpc.PrefillStub, [])
    task = OnlineTask(cfg.online_config, Knobs(4, 1.0, 0.1), clock, batcher=batcher, router=DeficitRouter(1.0),
                      partition=None, metrics=metrics, remote=remote, queued=lambda: 3, registry=metrics.registry)
    with caplog.at_level(logging.INFO, logger="easerve.encode"):
        for _ in range(8):  # the encoder busy 95 % of every second
            t = clock.now()
            task.arrival("image")
            metrics.on_batch(Dispatch(("r",), "size", t, 0.0), 4, t, t + 0.95)
            clock.advance(1.0)
            task.step()
    assert batcher.config.max_batch == 8
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "easerve:online_changes_total", knob="max_batch", reason="encode_busy") == 1
    assert metric(text, "easerve:online_knob", knob="max_batch") == 8
    assert metric(text, "easerve:desired_instances", stage="encode") == 1  # bounds 1:1 by default
    assert "easerve:desired_instances{stage=\"decode\"}" not in text        # not visible from encode
    assert any("max_batch 4 -> 8 (encode_busy" in r.getMessage() for r in caplog.records)


def test_reconfigure_keeps_the_queue_and_routes_at_the_new_s():
    b = AdaptiveBatcher(BatcherConfig(max_batch=8, mode="fixed"))
    for i in range(3):
        assert b.add(i, 0.0) is None
    b.reconfigure(BatcherConfig(max_batch=2, mode="fixed"))
    d = b.poll(0.0)
    assert d is not None and d.item_ids == (0, 1) and d.reason == "size" and b.pending == 1
    r = DeficitRouter(1.0)
    [r.route() for _ in range(5)]
    r.retarget(0.5)
    assert [r.route() for _ in range(4)].count("remote") == 2 and abs(r.error) <= 0.5


def test_remote_prefill_utilization_comes_from_its_busy_seconds_not_from_holding_requests():
    """Two remote prefill instances that always hold a request (Load's inflight > 0) but compute
    10 % of the time (Load's busy_s): the controller sees 0.1 (the counters' increase, not what
    they held before) and asks for one instance, not more."""
    import asyncio

    async def main():
        cfg = encode_cfg(online_instances="1:4")
        clock = ManualClock()
        metrics = EncodeMetrics(1.0, clock=clock)
        remote = Peers(prefill_pb2_grpc.PrefillStub, ["127.0.0.1:1", "127.0.0.1:2"])
        task = OnlineTask(cfg.online_config, Knobs(4, 1.0, 0.1), clock, batcher=AdaptiveBatcher(cfg.batcher),
                          router=DeficitRouter(1.0), partition=None, metrics=metrics, remote=remote,
                          queued=lambda: 0, registry=metrics.registry)
        peers = [remote.get(a) for a in remote.addrs]
        for p in peers:
            p.reported, p.busy_s = 2, 50.0  # counters from before this encode started watching
        for _ in range(8):
            clock.advance(1.0)
            for p in peers:
                p.busy_s += 0.1
            task.step()
        est = task.ctl.estimates(clock.now())
        await remote.close()
        return est, task, metrics

    est, task, metrics = asyncio.run(main())
    assert est.util("prefill") == pytest.approx(0.1, abs=1e-6)
    moves = [(c.old, c.new, c.reason) for c in task.ctl.changes if c.knob == "instances_prefill"]
    assert moves == [(2, 1, "stage_idle")]  # 2 x 0.1 fits one instance under the target
    assert metric(generate_latest(metrics.registry).decode(), "easerve:desired_instances", stage="prefill") == 1


def test_a_batch_longer_than_the_window_counts_as_busy_while_it_runs():
    """One encode batch of 12 s (B grown large on a slow device) against a 5 s window: the
    controller sees a busy encoder throughout, not an idle one until the batch ends."""
    cfg = encode_cfg(max_batch=4)
    clock = ManualClock()
    metrics = EncodeMetrics(1.0, clock=clock)
    batcher = AdaptiveBatcher(cfg.batcher)
    task = OnlineTask(cfg.online_config, Knobs(4, 1.0, 0.1), clock, batcher=batcher, router=DeficitRouter(1.0),
                      partition=None, metrics=metrics, remote=Peers(prefill_pb2_grpc.PrefillStub, []),
                      queued=lambda: 4, registry=metrics.registry)
    metrics.on_batch_start(clock.now())
    for _ in range(10):
        clock.advance(1.0)
        task.step()
    assert task.ctl.estimates(clock.now()).util("encode") == pytest.approx(1.0)
    assert batcher.config.max_batch == 8  # grown (encode_busy), never shrunk as idle
    assert [c.reason for c in task.ctl.changes if c.knob == "max_batch"] == ["encode_busy"]
    clock.advance(2.0)
    metrics.on_batch(Dispatch(("r",), "size", 0.0, 0.0), 4, 0.0, clock.now())
    assert metrics.encode_busy_at(clock.now()) == pytest.approx(12.0)
