"""The prefill and decode services record a bounded span per call (GET /trace's "spans")."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from easerve.policy.clock import ManualClock
from easerve.stages.common.call_spans import CallSpans
from easerve.stages.decode.async_engine import AsyncEngine
from easerve.stages.prefill.loop import PrefillLoop


def test_call_spans_are_bounded_windowed_and_served():
    now = [100.0]
    cs = CallSpans(maxlen=3, clock=lambda: now[0])
    for i in range(5):
        cs.record("prefill", 10.0 * i, 10.0 * i + 1, 2, tokens=40 + i)
    assert [s["tokens"] for s in cs.spans()] == [42, 43, 44]  # the latest 3
    assert cs.http(SimpleNamespace(query={"window_s": "65"})) == {
        "now": 100.0, "spans": [{"kind": "prefill", "start": 40.0, "end": 41.0, "batch": 2, "tokens": 44}]}
    with pytest.raises(ValueError):
        cs.record("decode", 2.0, 1.0, 1)


def test_trace_returns_as_many_of_the_latest_spans_as_asked():
    """The fidelity replay asks for all the spans of a cell (`?last=`), more than the default 500."""
    from aiohttp import web

    from easerve.stages.common.call_spans import LAST
    cs = CallSpans(clock=lambda: 1e4)
    for i in range(LAST + 700):
        cs.record("decode", float(i), i + 0.5, 1, context=i)
    assert len(cs.http(SimpleNamespace(query={"window_s": "1e5"}))["spans"]) == LAST
    got = cs.http(SimpleNamespace(query={"window_s": "1e5", "last": "100000"}))["spans"]
    assert [s["context"] for s in got] == list(range(LAST + 700))
    for bad in ("0", "x"):
        with pytest.raises(web.HTTPBadRequest) as e:
            cs.http(SimpleNamespace(query={"last": bad}))
        assert e.value.text == f"last must be a whole number >= 1, got {bad!r}"


def test_prefill_loop_records_each_batch_with_its_prompt_tokens():
    async def main():
        loop = PrefillLoop(adapter=None, clock=ManualClock(7.0))
        loop._pool = None
        loop._run_sync = lambda reqs: SimpleNamespace(outcomes=[(None, (1,))] * len(reqs), t0=7.0, t1=7.25,
                                                      forward_size=len(reqs))
        await loop._run([SimpleNamespace(req=SimpleNamespace(input_ids=[0] * n), future=asyncio.Future())
                         for n in (30, 50)])
        return loop.spans.spans()
    assert asyncio.run(main()) == [{"kind": "prefill", "start": 7.0, "end": 7.25, "batch": 2, "tokens": 80}]


class FakeEngine:
    def __init__(self):
        self.left, self.last_step = 2, (0, 0)

    @property
    def has_work(self):
        return self.left > 0

    def step(self):
        self.left -= 1
        self.last_step = (3, 120 + self.left)
        return []


def test_decode_engine_records_each_step_with_batch_and_context():
    async def main():
        eng = AsyncEngine(FakeEngine())
        eng.start()
        eng._wake.set()
        for _ in range(200):
            if len(eng.spans.spans()) == 2:
                break
            await asyncio.sleep(0.01)
        await eng.stop()
        return eng.spans.spans()
    spans = asyncio.run(main())
    assert [(s["kind"], s["batch"], s["context"]) for s in spans] == [("decode", 3, 121), ("decode", 3, 120)]
    assert all(s["start"] <= s["end"] for s in spans)
