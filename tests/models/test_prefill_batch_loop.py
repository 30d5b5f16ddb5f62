"""PrefillLoop over a real tiny Qwen2.5-VL prefill adapter: continuous batching, results equal
the direct adapter call, per-request sampling, cancellation, failure isolation, stop.

A gate scope (the `scope=` hook, run in the executor thread around each forward) holds a
batch in flight until the test lets it go, so which requests share a batch is deterministic."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from easerve.policy.clock import ManualClock
from easerve.policy.prefill_plan import PrefillBatchConfig
from easerve.engine.sampler import sample
from easerve.stages.prefill.loop import PrefillLoop
from easerve.types import PrefillRequest, SamplingParams

FAMILY = "qwen2.5-vl"


class Gate:
    """scope(): each forward waits for `release()`; `entered` counts forwards begun."""

    def __init__(self):
        self.opened, self.entered, self.fail_next = threading.Event(), 0, None

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        self.opened.wait(30)
        yield

    def release(self):
        self.opened.set()


async def until(cond, timeout=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def run(pre, work, config=None, **kw):
    async def main():
        loop = PrefillLoop(pre, config or PrefillBatchConfig(), **kw)
        loop.start()
        try:
            return await work(loop)
        finally:
            await loop.stop()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def reqs(mixed_requests):
    return mixed_requests(FAMILY)


def test_arrivals_during_a_batch_form_the_next_batch(pre, reqs):
    gate, busy = Gate(), []

    async def work(loop):
        first = asyncio.create_task(loop.prefill(reqs[0]))
        await until(lambda: gate.entered == 1)              # r0's batch is in the forward
        rest = [asyncio.create_task(loop.prefill(r)) for r in reqs[1:]]
        await until(lambda: loop.batcher.pending == len(rest))
        gate.release()
        return await first, await asyncio.gather(*rest)

    first, rest = run(pre, work, scope=gate, on_busy=lambda t0, t1: busy.append((t0, t1)))
    assert first.batch_size == 1 and [o.batch_size for o in rest] == [len(reqs) - 1] * (len(reqs) - 1)
    assert len(busy) == 2 and all(t0 <= t1 for t0, t1 in busy) and busy[0][1] <= busy[1][0]
    assert rest[0].prefill_ms == rest[-1].prefill_ms > 0
    for req, one in zip(reqs, [first, *rest]):
        ref = pre.prefill_one(req)
        assert one.result.request_id == req.request_id and one.result.prompt_len == ref.prompt_len
        assert one.first_token == int(ref.last_logits.argmax())
        torch.testing.assert_close(one.result.last_logits, ref.last_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(one.result.keys[0], ref.keys[0], atol=1e-4, rtol=1e-4)


def test_a_request_that_can_meet_its_tier_is_prefilled_before_best_effort_work(pre, reqs):
    """One request per forward: queued behind a running batch, a best-effort request (yields) and
    a batch-class one come before a request with a deadline, which still goes first."""
    gate, order = Gate(), []

    async def work(loop):
        async def one(r, **slo):
            out = await loop.prefill(r, **slo)
            order.append(r.request_id)
            return out

        first = asyncio.create_task(one(reqs[0]))
        await until(lambda: gate.entered == 1)
        rest = [asyncio.create_task(one(reqs[1], slo_s=5.0, yields=True)),
                asyncio.create_task(one(reqs[2], yields=True)),
                asyncio.create_task(one(reqs[3], slo_s=30.0))]
        await until(lambda: loop.batcher.pending == 3)
        gate.release()
        return await first, await asyncio.gather(*rest)

    run(pre, work, PrefillBatchConfig(max_batch_size=1), scope=gate)
    assert order == [reqs[k].request_id for k in (0, 3, 1, 2)]


def test_token_budget_splits_a_burst(pre, reqs):
    lens = [len(r.input_ids) for r in reqs]
    config = PrefillBatchConfig(max_batched_tokens=lens[0] + lens[1], max_batch_size=8)

    async def work(loop):
        return await asyncio.gather(*(loop.prefill(r) for r in reqs))

    outs = run(pre, work, config)
    sizes = [o.batch_size for o in outs]
    assert sizes[:2] == [2, 2] and max(sizes) < len(reqs)
    assert [o.first_token for o in outs] == [int(pre.prefill_one(r).last_logits.argmax()) for r in reqs]


def test_per_request_sampling_params(pre, reqs):
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7)
    mixed = [reqs[0], PrefillRequest("s", reqs[1].input_ids, reqs[1].embeddings, reqs[1].items_meta, seeded)]

    async def work(loop):
        return await asyncio.gather(*(loop.prefill(r) for r in mixed))

    greedy, sampled = run(pre, work)
    assert greedy.batch_size == sampled.batch_size == 2
    assert greedy.first_token == int(greedy.result.last_logits.argmax())
    assert sampled.first_token == sample(sampled.result.last_logits[None], [seeded], [0])[0]


def test_cancelled_while_queued_leaves_the_queue(pre, reqs):
    gate = Gate()

    async def work(loop):
        first = asyncio.create_task(loop.prefill(reqs[0]))
        await until(lambda: gate.entered == 1)
        dropped, kept = asyncio.create_task(loop.prefill(reqs[1])), asyncio.create_task(loop.prefill(reqs[2]))
        await until(lambda: loop.batcher.pending == 2)
        dropped.cancel()
        await until(lambda: loop.batcher.pending == 1)
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return await first, await kept

    first, kept = run(pre, work, scope=gate)
    assert (first.batch_size, kept.batch_size) == (1, 1)
    assert kept.result.request_id == reqs[2].request_id


def test_a_bad_request_fails_alone(pre, reqs):
    bad = PrefillRequest("bad", reqs[0].input_ids, reqs[0].embeddings * 2, reqs[0].items_meta * 2)

    async def work(loop):
        return await asyncio.gather(*(loop.prefill(r) for r in (reqs[0], bad, reqs[2])), return_exceptions=True)

    good0, err, good2 = run(pre, work)
    assert isinstance(err, ValueError) and "request bad" in str(err)
    assert good0.batch_size == good2.batch_size == 2
    assert good2.first_token == int(pre.prefill_one(reqs[2]).last_logits.argmax())


def test_empty_prompt_is_refused_at_the_door(pre):
    async def work(loop):
        with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
            await loop.prefill(PrefillRequest("empty", [], [], []))
        return loop.batcher.pending

    assert run(pre, work) == 0


def test_a_failing_batch_fails_its_requests_and_the_loop_keeps_serving(pre, reqs):
    gate = Gate()
    gate.release()
    gate.fail_next = RuntimeError("device lost")

    async def work(loop):
        failed = await asyncio.gather(*(loop.prefill(r) for r in reqs[:2]), return_exceptions=True)
        after = await loop.prefill(reqs[2])
        return failed, after

    failed, after = run(pre, work, scope=gate)
    assert all(isinstance(e, RuntimeError) and "device lost" in str(e) for e in failed)
    assert after.batch_size == 1 and after.first_token == int(pre.prefill_one(reqs[2]).last_logits.argmax())


def test_stop_fails_waiting_requests_and_prefill_needs_start(pre, reqs):
    gate = Gate()

    async def main():
        loop = PrefillLoop(pre, scope=gate)
        with pytest.raises(RuntimeError, match="call start"):
            await loop.prefill(reqs[0])
        loop.start()
        running = asyncio.create_task(loop.prefill(reqs[0]))
        await until(lambda: gate.entered == 1)
        queued = asyncio.create_task(loop.prefill(reqs[1]))
        await until(lambda: loop.batcher.pending == 1)
        await loop.stop()
        gate.release()
        return await asyncio.gather(running, queued, return_exceptions=True), loop.batcher.pending

    outs, pending = asyncio.run(main())
    assert pending == 0 and all(isinstance(e, RuntimeError) and "stopped" in str(e) for e in outs)


def test_a_given_executor_is_used_and_left_running(pre, reqs):
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mine")
    names = []

    @contextlib.contextmanager
    def scope():
        names.append(threading.current_thread().name)
        yield

    async def work(loop):
        return await loop.prefill(reqs[0])

    try:
        one = run(pre, work, executor=pool, scope=scope)
        assert one.batch_size == 1 and names and names[0].startswith("mine")
        assert pool.submit(lambda: 7).result() == 7  # stop() did not shut it down
    finally:
        pool.shutdown()


def test_every_time_the_loop_reads_comes_from_its_clock(pre, reqs):
    busy = []

    async def work(loop):
        return await loop.prefill(reqs[0])

    one = run(pre, work, clock=ManualClock(50.0), on_busy=lambda t0, t1: busy.append((t0, t1)))
    assert one.prefill_ms == 0.0 and busy == [(50.0, 50.0)]
