"""The asyncio front of the decode engine on a real tiny decoder: reservation streams,
submit, cancellation, and a failing step that fails every open stream at once."""
from __future__ import annotations

import asyncio

import pytest
import torch

from easerve.engine.config import EngineConfig

from easerve.engine.engine import DecodeEngine
from easerve.errors import EngineFailed, NotFound, Overloaded
from easerve.stages.decode.async_engine import AsyncEngine
from easerve.types import SamplingParams
from tests.models.text_lm import TextLMSpec, build_text_lm, payload_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return build_text_lm(TextLMSpec(family="llama", seed=3))


def _engine(lm, **kw) -> DecodeEngine:
    return DecodeEngine(lm, EngineConfig(**{"max_running": 4, "max_waiting": 2, "num_slots": 4, "max_seq_len": 96,
                                            **kw}))


def _payload(lm, rid: str, n: int = 6):
    return payload_for(lm, rid, list(range(5, 5 + n)), SamplingParams(max_tokens=8, ignore_eos=True))


def test_open_submit_stream_and_the_reservation_is_the_stream(lm):
    async def main():
        eng = AsyncEngine(_engine(lm))
        eng.start()
        try:
            async with eng.open("a", 6, 8, ttl_s=30) as stream:
                assert eng.num_streams == 1
                await eng.submit(_payload(lm, "a"))
                outs = [o async for o in stream]
            assert [o.index for o in outs] == list(range(8)) and outs[-1].finish_reason == "length"
            assert eng.num_streams == 0
            with pytest.raises(NotFound, match="no reservation"):
                await eng.submit(_payload(lm, "b"))  # nobody holds a place for it
        finally:
            await eng.stop()
    asyncio.run(main())


def run_started(make, body) -> None:
    """In a fresh event loop: start the AsyncEngine make() returns, await body(engine), stop it."""
    async def main():
        eng = make()
        eng.start()
        try:
            await body(eng)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_leaving_open_early_frees_the_place_and_the_kv(lm):
    async def body(eng):
        free = (await eng.stats()).kv_free_tokens
        async with eng.open("a", 6, 8, ttl_s=30) as stream:
            await eng.submit(_payload(lm, "a"))
            async for o in stream:
                if o.index == 2:
                    break
        for _ in range(50):
            s = await eng.stats()
            if s.running == 0 and s.kv_free_tokens == free:
                break
            await asyncio.sleep(0.02)
        assert s.running == 0 and s.waiting == 0 and s.kv_free_tokens == free
    run_started(lambda: AsyncEngine(_engine(lm)), body)


def test_a_full_engine_refuses_at_open(lm):
    async def body(eng):
        async with eng.open("a", 6, 8, ttl_s=30):
            async with eng.open("b", 6, 8, ttl_s=30):
                with pytest.raises(Overloaded):
                    async with eng.open("c", 6, 8, ttl_s=30):
                        pass
    run_started(lambda: AsyncEngine(_engine(lm, max_running=1, max_waiting=2, num_slots=1)), body)


def test_a_failing_step_fails_every_open_stream_and_reports_once(lm):
    async def main():
        engine = _engine(lm)
        fatal = []
        eng = AsyncEngine(engine, on_fatal=fatal.append)
        real_step, calls = engine.step, []

        def step():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("CUDA error: an illegal memory access")
            return real_step()
        engine.step = step
        eng.start()
        try:
            async def one(rid):
                async with eng.open(rid, 6, 8, ttl_s=30) as stream:
                    await eng.submit(_payload(lm, rid))
                    return [o async for o in stream]
            results = await asyncio.wait_for(asyncio.gather(one("a"), one("b"), return_exceptions=True), 20)
            assert all(isinstance(r, EngineFailed) and "illegal memory access" in str(r) for r in results), results
            assert len(fatal) == 1 and isinstance(fatal[0], RuntimeError)
            with pytest.raises(EngineFailed, match="no new requests"):
                async with eng.open("c", 6, 8, ttl_s=30):
                    pass
        finally:
            await eng.stop()
    asyncio.run(main())
