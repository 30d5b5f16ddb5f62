"""Prefix caching over the real tiny checkpoints of every family: a later turn of a chat about
one medium takes the KV of the earlier turn from the cache, computes only the rest, and gives
the KV, rope delta and greedy tokens of a cold prefill (batched with others, under both
attention paths); a different medium at the same positions misses."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from easerve.cache.prefix import PrefixCacheConfig
from easerve.cache.prefix_kv import PrefixKV
from easerve.types import PrefillRequest, items_meta

FAMILIES = ["llava-next", "qwen2.5-vl", "qwen2-audio", "ultravox"]
BT = 4


def _medium(mm, rng, family: str, seed_shift: int = 0) -> dict:
    rng = np.random.RandomState(7 + seed_shift)
    if family == "llava-next":
        return {"type": "image", "image": mm.image(rng, 40, 60)}
    if family == "qwen2.5-vl":
        return {"type": "image", "image": mm.image(rng, 56, 84)}
    return {"type": "audio", "audio": mm.audio(rng, 0.6)}


def _turns(mm, medium) -> list[list[dict]]:
    """Three growing turns of one chat about `medium`."""
    first = mm.user(medium, "What is in this input?")
    second = [*first, {"role": "assistant", "content": "Something small and blue."},
              {"role": "user", "content": "Say more about its color."}]
    third = [*second, {"role": "assistant", "content": "Blue, light blue."},
             {"role": "user", "content": "And its shape?"}]
    return [first, second, third]


def _request(enc, full, messages, rid: str) -> PrefillRequest:
    prompt = full.preprocess(messages)
    for it in prompt.items:  # the gateway's content hash: here, of the item's processor inputs
        h = hashlib.sha256()
        for t in it.pixels.values():
            h.update(t.numpy().tobytes())
        it.content_hash = h.digest()
    return PrefillRequest(rid, prompt.input_ids, enc.encode(prompt.items), items_meta(prompt.items))


def _prefill(pre, kv: PrefixKV, reqs: list[PrefillRequest]):
    looks = [kv.lookup(r) for r in reqs]
    try:
        results = pre.prefill(reqs, [lk.prefix for lk in looks])
        for lk, res in zip(looks, results):
            kv.store(lk, res)
        return looks, results
    finally:
        for lk in looks:
            kv.release(lk)


def _same(pre, decode_greedy, got, cold) -> None:
    assert (got.prompt_len, got.rope_delta) == (cold.prompt_len, cold.rope_delta)
    for a, b in zip(got.keys + got.values, cold.keys + cold.values):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.last_logits, cold.last_logits, atol=1e-4, rtol=1e-4)
    assert decode_greedy(pre, got) == decode_greedy(pre, cold)


def _placeholders(pre, req) -> list[int]:
    ids = set(pre.placeholder_ids.values())
    return [p for p, t in enumerate(req.input_ids) if t in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_later_turns_hit_and_equal_a_cold_prefill(adapters, mm, rng, family, decode_greedy, mixed_requests):
    full, enc, pre = adapters(family, "full"), adapters(family, "encode"), adapters(family, "prefill")
    kv = PrefixKV.for_adapter(pre, PrefixCacheConfig(block_tokens=BT))
    turns = [_request(enc, full, m, f"t{k}") for k, m in enumerate(_turns(mm, _medium(mm, rng, family)))]
    looks, _ = _prefill(pre, kv, turns[:1])
    assert looks[0].hit_blocks == 0 and kv.hits == 0
    for k in (1, 2):
        other = mixed_requests(family)[1]  # batched with a request the cache has not seen
        cold = pre.prefill([turns[k]])[0]
        looks, (res, res_other) = _prefill(pre, kv, [turns[k], other])
        assert res.cached_tokens == looks[0].hit_blocks * BT > _placeholders(pre, turns[k])[-1]  # the medium hit
        assert res.cached_tokens >= len(turns[k - 1].input_ids) - BT
        _same(pre, decode_greedy, res, cold)
        _same(pre, decode_greedy, res_other, pre.prefill([other])[0])
    assert kv.hits > 0 and kv.queries == sum(len(t.input_ids) for t in turns) + 2 * len(mixed_requests(family)[1].input_ids)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen2-audio"])
def test_a_different_medium_at_the_same_positions_misses(adapters, mm, rng, family):
    full, enc, pre = adapters(family, "full"), adapters(family, "encode"), adapters(family, "prefill")
    kv = PrefixKV.for_adapter(pre, PrefixCacheConfig(block_tokens=BT))
    a = _request(enc, full, _turns(mm, _medium(mm, rng, family))[1], "a")
    b = _request(enc, full, _turns(mm, _medium(mm, rng, family, seed_shift=1))[1], "b")
    assert len(a.input_ids) == len(b.input_ids)
    _prefill(pre, kv, [a])
    look = kv.lookup(b)
    kv.release(look)
    assert look.hit_blocks * BT <= _placeholders(pre, b)[0]  # nothing from the first placeholder on
    look = kv.lookup(a)
    kv.release(look)
    assert look.hit_blocks * BT > _placeholders(pre, a)[-1]


def test_mask_attention_path_equals_a_cold_prefill(tiny_checkpoint, adapters, mm, rng, decode_greedy):
    """An LM switched to the decode engine's attention (the monolith shares it with prefill)
    takes the block mask path; with cached prefixes it equals a cold prefill too."""
    from easerve.engine.attention import use_engine_attention
    from easerve.models.loader import load_adapter

    family = "qwen2.5-vl"
    pre = load_adapter(tiny_checkpoint(family), role="prefill")
    use_engine_attention(pre.language_model)
    full, enc = adapters(family, "full"), adapters(family, "encode")
    kv = PrefixKV.for_adapter(pre, PrefixCacheConfig(block_tokens=BT))
    turns = [_request(enc, full, m, f"t{k}") for k, m in enumerate(_turns(mm, _medium(mm, rng, family)))]
    _prefill(pre, kv, turns[:1])
    looks, results = _prefill(pre, kv, turns[1:])
    assert looks[0].hit_blocks == looks[1].hit_blocks == len(turns[0].input_ids) // BT > 0  # turn 0's blocks
    for t, res in zip(turns[1:], results):
        _same(pre, decode_greedy, res, adapters(family, "prefill").prefill([t])[0])


def test_the_prefill_loop_uses_the_cache_and_budgets_the_uncached_tokens(adapters, mm, rng, mixed_requests):
    import asyncio

    from easerve.policy.prefill_plan import PrefillBatchConfig
    from easerve.stages.prefill.loop import PrefillLoop

    family = "qwen2.5-vl"
    full, enc, pre = adapters(family, "full"), adapters(family, "encode"), adapters(family, "prefill")
    turns = [_request(enc, full, m, f"t{k}") for k, m in enumerate(_turns(mm, _medium(mm, rng, family)))]
    other = mixed_requests(family)[2]
    kv = PrefixKV.for_adapter(pre, PrefixCacheConfig(block_tokens=BT))

    async def main():
        loop = PrefillLoop(pre, PrefillBatchConfig(max_batched_tokens=10**6), prefix=kv)
        loop.start()
        try:
            one = await loop.prefill(turns[0])
            # turn 2 and another request fit the budget together only by what turn 2 leaves to compute
            left = kv.to_compute(turns[1]), kv.to_compute(other)  # (other shares the system prompt's block)
            assert left[0] <= len(turns[1].input_ids) - len(turns[0].input_ids) + BT
            loop.batcher.config = PrefillBatchConfig(max_batched_tokens=sum(left))
            return left, one, *await asyncio.gather(loop.prefill(turns[1]), loop.prefill(other))
        finally:
            await loop.stop()

    left, one, two, three = asyncio.run(main())
    assert one.result.cached_tokens == 0 and two.result.cached_tokens == len(turns[1].input_ids) - left[0]
    assert two.batch_size == three.batch_size == 2
    for got, req in ((two, turns[1]), (three, other)):
        assert got.first_token == int(pre.prefill([req])[0].last_logits.argmax())
