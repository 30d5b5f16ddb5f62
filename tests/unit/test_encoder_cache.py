"""The encoder cache's bookkeeping (easerve.cache.policy) and media hashes (easerve.media.content_hash)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from easerve.cache.policy import HIT, MISS, PENDING, EncoderCachePolicy, HolderMap
from easerve.media.content_hash import assign_by_modality, media_hash
from easerve.types import MMItem

# ---- policy: states ------------------------------------------------------------------------


def test_single_flight_states():
    c = EncoderCachePolicy(100)
    assert c.lookup("a").state == MISS
    c.begin("a")
    assert c.lookup("a").state == PENDING          # a second request waits, it does not begin
    with pytest.raises(ValueError, match="already held or in flight"):
        c.begin("a")
    assert c.complete("a", "emb-a", 10) == []
    hit = c.lookup("a")
    assert (hit.state, hit.value) == (HIT, "emb-a")
    assert (c.stats.misses, c.stats.joins, c.stats.hits) == (1, 1, 1)
    assert c.bytes == 10 and c.inflight == 0


def test_fail_forgets_an_inflight_key_and_misuse_is_refused():
    c = EncoderCachePolicy(100)
    c.begin("a")
    c.fail("a")
    assert c.lookup("a").state == MISS and c.inflight == 0
    with pytest.raises(ValueError, match="not in flight"):
        c.fail("a")
    with pytest.raises(ValueError, match="begin\\(\\) it first"):
        c.complete("b", "x", 1)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        EncoderCachePolicy(-1)


def test_lru_order_and_eviction_by_bytes():
    c = EncoderCachePolicy(30)
    for k in "abc":
        c.begin(k)
        c.complete(k, k, 10)
    c.lookup("a")                       # a is now the most recently used
    c.begin("d")
    assert c.complete("d", "d", 15) == ["b", "c"]   # least recently used first, until it fits
    assert c.keys() == ["a", "d"] and c.bytes == 25 and c.stats.evictions == 2


def test_a_value_larger_than_the_cache_is_not_held_and_capacity_zero_holds_nothing():
    c = EncoderCachePolicy(10)
    c.begin("a")
    c.complete("a", "a", 5)
    c.begin("big")
    assert c.complete("big", "big", 11) == []
    assert c.keys() == ["a"] and c.stats.oversized == 1
    z = EncoderCachePolicy(0)
    z.begin("x")
    z.complete("x", "x", 1)
    assert len(z) == 0 and z.bytes == 0


# ---- policy: properties --------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 7), st.integers(0, 40)),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 100), ops=ops)
def test_bytes_never_exceed_the_bound_and_match_what_is_held(capacity, ops):
    c = EncoderCachePolicy(capacity)
    sizes = {}
    for op, key, size in ops:
        if op == "get":
            c.lookup(key)
        elif c.lookup(key).state == MISS:
            c.begin(key)
            for k in c.complete(key, key, size):
                assert k not in c
            sizes[key] = size
        assert c.bytes <= capacity
        assert c.bytes == sum(sizes[k] for k in c.keys())


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 100), ops=ops)
def test_eviction_takes_the_least_recently_used(capacity, ops):
    """Against a plain list model: evicted keys are always the oldest-touched ones."""
    c = EncoderCachePolicy(capacity)
    order: list[int] = []      # least recently used first
    size_of: dict[int, int] = {}
    for op, key, size in ops:
        found = c.lookup(key).state
        if found == HIT:
            order.remove(key)
            order.append(key)
        elif op == "put":
            c.begin(key)
            evicted = c.complete(key, key, size)
            if size <= capacity:
                order.append(key)
                size_of[key] = size
                expect = []
                while sum(size_of[k] for k in order) > capacity:
                    expect.append(order.pop(0))
                assert evicted == expect
            else:
                assert evicted == []
        assert c.keys() == order


# ---- the holder map (the miss error crossing gRPC: tests/unit/test_rpc.py) -----------------


def test_holder_map_prefers_the_instance_holding_most_and_stays_bounded():
    m = HolderMap(3)
    m.note([b"a", b"b"], "e1:1")
    m.note([b"c"], "e2:1")
    assert m.holder([b"a", b"b", b"c"]) == "e1:1"
    assert m.holder([b"c", b"zz"]) == "e2:1" and m.holder([b"zz"]) is None
    m.note([b"d"], "e2:1")                            # past 3 entries the oldest (a) goes
    assert len(m) == 3 and m.holder([b"a"]) is None
    m.forget([b"b", b"c"], "e1:1")                    # only what was noted at e1
    assert m.holder([b"b"]) is None and m.holder([b"c"]) == "e2:1"


# ---- media hashes --------------------------------------------------------------------------
FP = b"\1" * 32


def test_media_hash_depends_on_content_settings_modality_and_fingerprint():
    raw = b"\x89PNG...."
    h = media_hash(FP, "image", raw)
    assert len(h) == 32 and h == media_hash(FP, "image", bytes(raw))
    assert h != media_hash(FP, "image", raw + b"!")
    assert h != media_hash(b"\2" * 32, "image", raw)
    assert h != media_hash(FP, "video", raw)
    assert media_hash(FP, "video", [raw], {"fps": 2.0}) != media_hash(FP, "video", [raw], {"fps": 4.0})
    a = np.zeros((4, 4), np.float32)
    assert media_hash(FP, "audio", a) != media_hash(FP, "audio", a.astype(np.float64))
    assert media_hash(FP, "audio", a) != media_hash(FP, "audio", a.reshape(2, 8))


def test_a_data_uri_hashes_as_the_bytes_it_carries():
    import base64
    raw = b"\x89PNG-bytes"
    b64 = base64.b64encode(raw).decode()
    assert media_hash(FP, "image", f"data:image/png;base64,{b64}") == media_hash(FP, "image", raw)
    assert media_hash(FP, "video", [b64, raw]) == media_hash(FP, "video", [raw, raw])


def test_media_hash_of_decoded_images_and_a_clear_error_for_other_objects():
    px = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    one = media_hash(FP, "image", Image.fromarray(px))
    assert one == media_hash(FP, "image", Image.fromarray(px.copy()))
    assert one != media_hash(FP, "image", Image.fromarray(px).convert("L"))
    with pytest.raises(ValueError, match="cannot hash media of type object"):
        media_hash(FP, "image", object())


def test_hashes_are_matched_to_items_per_modality_in_order():
    pairs = [("image", b"i0"), ("audio", b"a0"), ("image", b"i1")]
    assert assign_by_modality(pairs, ["image", "image", "audio"]) == [b"i0", b"i1", b"a0"]
    assert assign_by_modality(pairs, ["image", "audio"]) is None           # counts disagree
    assert assign_by_modality(pairs, ["image", "image", "audio", "video"]) is None


# ---- the gateway's learned item metadata ---------------------------------------------------


def _item(h: bytes, replacement: str, n: int = 3) -> MMItem:
    return MMItem("image", {"pixel_values": np.zeros(4)}, {"image_grid_thw": np.array([1, 2, 2])}, n, h, replacement)


def test_known_items_keep_no_pixels_store_token_runs_short_and_stay_bounded():
    from easerve.cache.gateway import KnownItems
    k = KnownItems(2, {"image": "<P>"})
    k.learn([_item(b"a", "<P>" * 3), _item(b"b", "<s><P><P></s>", 2), _item(b"", "<P>"), _item(b"n", "")])
    assert len(k) == 2                                  # no hash, or no replacement: nothing to learn
    a = k.get(b"a")
    assert (a.modality, a.pixels, a.num_tokens, a.content_hash, a.replacement) == ("image", {}, 3, b"a", "<P>" * 3)
    assert k._items[b"a"].unit == "<P>" and k._items[b"a"].repeat == 3
    assert k.get(b"b").replacement == "<s><P><P></s>"
    k.get(b"a")                                         # a read last: b is the least recently used
    k.learn([_item(b"c", "<P>")])
    assert k.get(b"b") is None and k.get(b"a") is not None and k.get(b"c") is not None


def test_a_media_plan_is_all_held_only_when_every_part_is():
    from easerve.cache.gateway import MediaPlan
    p = MediaPlan([("image", b"a"), ("image", b"a"), ("audio", b"b")], "e:1", {b"a": True, b"b": False})
    assert p.hashes == [b"a", b"b"] and not p.all_held
    p.held[b"b"] = True
    assert p.all_held and not MediaPlan([], "e:1").all_held
