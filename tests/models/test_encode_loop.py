"""The encode worker's asyncio micro-batching loop over a real tiny encoder."""
from __future__ import annotations

import asyncio

import pytest
import torch

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig
from easerve.policy.clock import ManualClock
from easerve.stages.encode.metrics import EncodeMetrics
from easerve.types import MMItem
from easerve.stages.encode.loop import EncodeLoop

FAMILY = "qwen2.5-vl"


def _items(enc, mm, rng, n):
    return [enc.preprocess(mm.user({"type": "image", "image": mm.image(rng, 28 + 14 * i, 42)}, "x")).items[0]
            for i in range(n)]


async def _run_loop(enc, cfg, work, metrics=None, clock=None):
    loop = EncodeLoop(enc, AdaptiveBatcher(cfg), metrics=metrics, clock=clock)
    loop.start()
    try:
        return await work(loop)
    finally:
        await loop.stop()


def test_batches_up_to_b_and_matches_one_by_one(enc, mm, rng):
    items = _items(enc, mm, rng, 5)

    async def work(loop):
        return await asyncio.gather(*(loop.encode(f"r{i}", [it]) for i, it in enumerate(items)))

    results = asyncio.run(_run_loop(enc, BatcherConfig(max_batch=4, max_gap_s=0.02), work))
    assert sorted(r.batch_size for r in results) == [1, 4, 4, 4, 4]
    for r, it in zip(results, items):
        assert torch.allclose(r.embeddings[0], enc.encode([it])[0], atol=1e-5)


def test_a_failing_batch_fails_its_requests_and_the_worker_keeps_serving(enc, mm, rng):
    good = _items(enc, mm, rng, 1)[0]
    bad = MMItem("image", {"pixel_values": torch.zeros(3, 7)}, dict(good.meta), good.num_tokens)

    async def work(loop):
        with pytest.raises(Exception):
            await loop.encode("bad", [bad])
        return await loop.encode("good", [good])

    res = asyncio.run(_run_loop(enc, BatcherConfig(max_batch=1, mode="request_at_a_time"), work))
    assert res.embeddings[0].shape[0] == good.num_tokens


def test_a_broken_metrics_hook_does_not_stall_encoding(enc, mm, rng):
    class Broken:
        def on_batch(self, *a):
            raise RuntimeError("boom")

    item = _items(enc, mm, rng, 1)[0]

    async def work(loop):
        first = await asyncio.wait_for(loop.encode("a", [item]), 30)
        second = await asyncio.wait_for(loop.encode("b", [item]), 30)
        return first, second

    a, b = asyncio.run(_run_loop(enc, BatcherConfig(max_batch=1, mode="request_at_a_time"), work, Broken()))
    assert torch.equal(a.embeddings[0], b.embeddings[0])


def test_a_cancelled_request_leaves_the_batcher(enc, mm, rng):
    item = _items(enc, mm, rng, 1)[0]

    async def work(loop):
        task = asyncio.create_task(loop.encode("gone", [item]))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return loop.batcher.pending

    assert asyncio.run(_run_loop(enc, BatcherConfig(max_batch=8, mode="fixed", safety_cap_s=5.0), work)) == 0


def test_every_time_the_loop_reads_comes_from_its_clock(enc, mm, rng):
    """A ManualClock that never moves: zero queue and encode times, spans at its time."""
    item = _items(enc, mm, rng, 1)[0]
    clock = ManualClock(50.0)
    metrics = EncodeMetrics(1.0, clock=clock)

    async def work(loop):
        return await asyncio.wait_for(loop.encode("a", [item]), 30)

    res = asyncio.run(_run_loop(enc, BatcherConfig(max_batch=1), work, metrics, clock))
    assert res.queue_ms == 0.0 and res.encode_ms == 0.0
    assert [(s.start, s.end) for s in metrics.trace.spans()] == [(50.0, 50.0)]
