"""The encode process's encoder cache (easerve.cache.embeddings) over real tiny encoders and the
real encode loop: a hit equals a fresh encode for every modality, N concurrent requests for
one medium run the tower once, a failed or cancelled first encode, and the byte bound."""
from __future__ import annotations

import asyncio

import pytest
import torch

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig
from easerve.errors import CacheMiss, Internal
from easerve.stages.common.metrics import new_registry
from easerve.stages.encode.loop import EncodeLoop
from easerve.types import MMItem, PrefillRequest, items_meta
from easerve.cache.embeddings import EmbeddingCache, model_fingerprint, tensor_nbytes
from easerve.stages.encode.metrics import CacheMetrics


def _hashed(item: MMItem, h: bytes) -> MMItem:
    return MMItem(item.modality, item.pixels, item.meta, item.num_tokens, content_hash=h)


def _bare(item: MMItem) -> MMItem:
    """The item as the gateway sends it on a probed hit: no pixels."""
    return MMItem(item.modality, {}, item.meta, item.num_tokens, content_hash=item.content_hash)


def _messages(mm, rng, modality: str):
    if modality == "image":
        return mm.user({"type": "image", "image": mm.image(rng, 56, 42)}, "Describe.")
    if modality == "video":
        return mm.user({"type": "video", "video": mm.video(rng, 4, 56, 56)}, "Describe.")
    return mm.audio_messages(rng, [0.7])


async def _with(enc, cache: EmbeddingCache, work, batcher: BatcherConfig | None = None):
    loop = EncodeLoop(enc, AdaptiveBatcher(batcher or BatcherConfig(max_batch=8, max_gap_s=0.02)))
    loop.start()
    try:
        return await work(lambda rid, items: cache.encode(rid, items, loop.encode))
    finally:
        await loop.stop()


def _cache(capacity: int = 2**30) -> tuple[EmbeddingCache, CacheMetrics]:
    m = CacheMetrics(new_registry())
    return EmbeddingCache(capacity, b"fp" * 16, m), m


def _first_token(pre, prompt, embeddings) -> int:
    req = PrefillRequest("r", prompt.input_ids, embeddings, items_meta(prompt.items))
    return int(pre.prefill([req])[0].last_logits.argmax())


@pytest.mark.parametrize("family,modality", [("qwen2.5-vl", "image"), ("qwen2.5-vl", "video"),
                                             ("qwen2-audio", "audio")])
def test_a_hit_equals_a_fresh_encode_and_gives_the_same_first_token(adapters, mm, rng, family, modality):
    enc, pre = adapters(family, "encode"), adapters(family, "prefill")
    prompt = enc.preprocess(_messages(mm, rng, modality))
    item = _hashed(prompt.items[0], b"\7" * 32)
    cache, m = _cache()

    async def work(encode):
        first = await encode("a", [item])
        again = await encode("b", [_bare(item)])   # no pixels: only the cache can answer
        return first, again

    first, again = asyncio.run(_with(enc, cache, work))
    fresh = enc.encode([prompt.items[0]])[0]
    assert torch.equal(again.embeddings[0], fresh) and torch.equal(first.embeddings[0], fresh)
    assert (first.hits, again.hits, again.encode_ms) == (0, 1, 0.0)
    assert m.tower_items._value.get() == 1 and m.hits._value.get() == 1 and m.pixel_free._value.get() == 1
    assert _first_token(pre, prompt, again.embeddings) == _first_token(pre, prompt, [fresh])


def test_concurrent_requests_for_one_image_run_the_tower_once(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    item = _hashed(enc.preprocess(_messages(mm, rng, "image")).items[0], b"\1" * 32)
    cache, m = _cache()
    n = 6

    async def work(encode):
        return await asyncio.gather(*(encode(f"r{i}", [item]) for i in range(n)))

    results = asyncio.run(_with(enc, cache, work))
    assert m.tower_items._value.get() == 1 and m.misses._value.get() == 1 and m.joins._value.get() == n - 1
    assert sorted(r.hits for r in results) == [0] + [1] * (n - 1)
    assert all(torch.equal(r.embeddings[0], results[0].embeddings[0]) for r in results)


def test_the_same_image_twice_in_one_request_is_encoded_once(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    item = _hashed(enc.preprocess(_messages(mm, rng, "image")).items[0], b"\2" * 32)
    cache, m = _cache()
    res = asyncio.run(_with(enc, cache, lambda encode: encode("r", [item, item])))
    assert m.tower_items._value.get() == 1 and torch.equal(res.embeddings[0], res.embeddings[1])


def test_waiters_get_a_clear_error_when_the_first_encode_fails(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    good = enc.preprocess(_messages(mm, rng, "image")).items[0]
    bad = MMItem("image", {"pixel_values": torch.zeros(3, 7)}, dict(good.meta), good.num_tokens, b"\3" * 32)
    cache, m = _cache()

    async def work(encode):
        return await asyncio.gather(encode("first", [bad]), encode("second", [bad]), return_exceptions=True)

    first, second = asyncio.run(_with(enc, cache, work))
    assert not isinstance(first, Internal)                    # the owner sees the encoder's own error
    assert isinstance(second, Internal) and "by request first failed" in str(second)
    assert len(cache.policy) == 0 and cache.policy.inflight == 0 and m.tower_items._value.get() == 0


def test_a_waiter_takes_over_when_the_first_request_is_cancelled(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    item = _hashed(enc.preprocess(_messages(mm, rng, "image")).items[0], b"\4" * 32)
    cache, m = _cache()

    async def work(encode):
        owner = asyncio.ensure_future(encode("owner", [item]))
        await asyncio.sleep(0)                                # owner has begun the key
        waiter = asyncio.ensure_future(encode("waiter", [item]))
        await asyncio.sleep(0)
        owner.cancel()
        return await waiter

    res = asyncio.run(_with(enc, cache, work, BatcherConfig(max_batch=8, max_gap_s=0.05)))
    assert torch.equal(res.embeddings[0], enc.encode([item])[0])
    assert m.tower_items._value.get() == 1 and cache.policy.holds(cache.key(item.content_hash))
    assert (m.misses._value.get(), m.joins._value.get()) == (2, 1)   # joined the owner, then took over


def test_eviction_keeps_the_held_bytes_within_the_bound(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    items = [_hashed(enc.preprocess(_messages(mm, rng, "image")).items[0], bytes([10 + i]) * 32) for i in range(5)]
    one = tensor_nbytes(enc.encode([items[0]])[0])
    cache, m = _cache(capacity=int(2.5 * one))

    async def work(encode):
        for i, it in enumerate(items):
            await encode(f"r{i}", [it])
            assert cache.policy.bytes <= cache.policy.capacity

    asyncio.run(_with(enc, cache, work))
    assert cache.holds([it.content_hash for it in items]) == [False, False, False, True, True]
    assert m.evictions._value.get() == 3 and m.bytes._value.get() == 2 * one


def test_an_item_without_pixels_that_is_not_held_is_a_cache_miss(adapters, mm, rng):
    enc = adapters("qwen2.5-vl", "encode")
    item = _hashed(enc.preprocess(_messages(mm, rng, "image")).items[0], b"\5" * 32)
    cache, _ = _cache()
    with pytest.raises(CacheMiss, match="resend the item with its inputs"):
        asyncio.run(_with(enc, cache, lambda encode: encode("r", [_bare(item)])))
    assert cache.policy.inflight == 0


def test_the_model_fingerprint_changes_with_dtype_and_weights(tiny_checkpoint, tmp_path):
    a = tiny_checkpoint("qwen2.5-vl")
    assert model_fingerprint(str(a), "torch.float32", "cpu") == model_fingerprint(str(a), "torch.float32", "cpu")
    assert model_fingerprint(str(a), "torch.float32", "cpu") != model_fingerprint(str(a), "torch.bfloat16", "cpu")
    assert model_fingerprint(str(a), "torch.float32", "cpu") != \
        model_fingerprint(str(tiny_checkpoint("qwen2.5-vl", seed=1)), "torch.float32", "cpu")
