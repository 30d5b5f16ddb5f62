"""Prefix cache bookkeeping (easerve.cache.prefix): block names and the kept-block policy."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easerve.cache.prefix import PrefixCache, PrefixCacheConfig, block_hashes
from easerve.fields import FieldError

BT = 4


def test_chained_names_share_exactly_the_common_prefix():
    a = block_hashes(list(range(12)), {}, BT)
    b = block_hashes(list(range(8)) + [99, 9, 10, 11], {}, BT)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert block_hashes(list(range(11)), {}, BT) == a[:2]  # only full blocks are named
    # a block's name depends on everything before it, not only on its own tokens
    assert block_hashes([7] + list(range(1, 12)), {}, BT)[1] != a[1]


def test_media_placeholders_are_named_by_content_hash():
    ids = [1, 2, 50, 50, 50, 50, 3, 4]  # 50: a placeholder; the image fills positions 2..5
    img = {p: b"A" * 32 for p in range(2, 6)}
    same = block_hashes(ids, img, BT)
    assert same == block_hashes(ids, dict(img), BT)
    other = block_hashes(ids, {p: b"B" * 32 for p in range(2, 6)}, BT)
    assert len(other) == 2 and other[0] != same[0] and other[1] != same[1]
    # an item without a content hash is not cacheable: the chain stops before its first block
    assert block_hashes(ids, {p: b"" for p in range(2, 6)}, BT) == []
    assert block_hashes(ids, {p: b"" for p in range(4, 6)}, BT) == block_hashes(ids, {}, BT)[:1]


def test_config_errors_name_the_field():
    with pytest.raises(FieldError, match="block_tokens"):
        PrefixCacheConfig(block_tokens=0)


def test_eviction_is_lru_of_unreferenced_blocks_tail_first():
    c = PrefixCache(PrefixCacheConfig(block_tokens=BT, budget_bytes=3 * 10), block_bytes=10)
    a = block_hashes(list(range(12)), {}, BT)
    assert c.insert(a).store == (0, 1, 2)
    c.acquire(a[:1])
    b = block_hashes([9] * 8, {}, BT)
    plan = c.insert(b)
    assert plan.store == (0, 1) and set(plan.evict) == {a[2], a[1]}  # a's tail left first, a[0] is referenced
    assert c.match(a) == 1 and c.match(b) == 2
    c.release(a[:1])  # just used: the most recent
    assert c.insert(block_hashes([5] * 4, {}, BT)).evict == (b[1],)  # b's tail is the least recent


def _prompts():
    return st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(prompts=_prompts(), capacity=st.integers(0, 8), held=st.lists(st.integers(0, 11), max_size=4),
       ops=st.lists(st.integers(0, 11), max_size=30))
def test_invariants(prompts, capacity, held, ops):
    """Budget never exceeded, referenced blocks never evicted, a match is the longest held prefix."""
    c = PrefixCache(PrefixCacheConfig(block_tokens=BT, budget_bytes=capacity * 100), block_bytes=100)
    chains = [block_hashes(p, {}, BT) for p in prompts]
    refs: list[list[bytes]] = []
    for k in [*held, *ops]:
        chain = chains[k % len(chains)]
        n = c.match(chain)
        assert all(c.holds(h) for h in chain[:n]) and (n == len(chain) or not c.holds(chain[n]))
        c.acquire(chain[:n])
        refs.append(chain[:n])
        pinned = {h for r in refs for h in r}
        plan = c.insert(chain)
        assert not set(plan.evict) & pinned, "a referenced block was evicted"
        assert all(c.holds(h) for h in pinned)
        assert c.used_bytes <= c.config.budget_bytes
        # every stored block is reachable: the chain is held from its start through it
        assert all(i < c.match(chain) for i in plan.store)
        if capacity >= len(chain) + len(pinned):  # room for it: the whole chain is held
            assert c.match(chain) == len(chain)
        if k in ops and refs:  # release the oldest reference now and then
            c.release(refs.pop(0))
    for r in refs:
        c.release(r)
    assert all(c.refs(h) == 0 for ch in chains for h in ch)


def test_route_prefers_the_holder_of_the_longest_prefix_while_its_load_allows():
    from easerve.cache.prefix_route import PrefixRoute

    r = PrefixRoute(block_tokens=BT, placeholder_ids={"image": 50}, affinity=2)
    short, long_ = r.hashes(list(range(8))), r.hashes(list(range(16)))
    r.sent(short, "a:1")
    r.sent(long_[:3], "b:1")
    assert long_[:2] == short and r.holder(long_) == ("b:1", 3)
    assert r.holder(short) == ("b:1", 2)  # short's blocks went to b last
    assert r.prefer(long_, {"a:1": 0, "b:1": 2}) == "b:1"
    assert r.prefer(long_, {"a:1": 0, "b:1": 3}) is None           # too busy: least loaded decides
    assert r.prefer(long_, {"a:1": 0}) is None                     # holder down
    assert r.prefer(r.hashes([9] * 16), {"a:1": 0, "b:1": 0}) is None  # nothing noted
    img = [1, 2, 50, 50, 50, 50, 3, 4]
    r.sent(r.hashes(img, [("image", 4, b"A" * 32)]), "c:1")
    assert r.holder(r.hashes(img, [("image", 4, b"A" * 32)]))[0] == "c:1"
    assert r.holder(r.hashes(img, [("image", 4, b"B" * 32)]))[0] is None
