"""BlockManager bookkeeping and the Scheduler policy built on it (both torch-free)."""
import sys

import pytest
from hypothesis import given, settings, strategies as st

from easerve.engine.block_manager import BlockManager
from easerve.errors import Overloaded, RequestTooLarge
from easerve.engine.scheduler import Scheduler


def test_torch_free():
    for mod in ("easerve.engine.block_manager", "easerve.engine.scheduler", "easerve.errors"):
        src = open(sys.modules[mod].__file__).read()
        assert "import torch" not in src


def test_paged_allocate_reserves_whole_request_and_free_returns_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.capacity_tokens == bm.free_tokens == 32
    table = bm.allocate("a", num_tokens=5, reserve_tokens=10)   # 3 blocks
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.free_tokens == 20 and bm.reserved_tokens == 12 and bm.used_tokens == 5
    assert bm.block_table("a") == tuple(table)
    assert bm.free("a") and not bm.free("a")
    assert bm.free_tokens == 32 and bm.used_tokens == 0


def test_append_hands_out_positions_until_reservation_ends():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", num_tokens=3, reserve_tokens=6)
    assert [bm.append("a") for _ in range(3)] == [3, 4, 5]
    assert not bm.can_append("a")
    with pytest.raises(RuntimeError, match="reservation"):
        bm.append("a")


def test_can_allocate_and_fits_ever():
    bm = BlockManager(num_blocks=4, block_size=4, max_seq_tokens=12)
    assert bm.can_allocate(16) and not bm.fits_ever(13) and bm.fits_ever(12)
    bm.allocate("a", 4, 8)
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    with pytest.raises(RuntimeError):
        bm.allocate("b", 4, 9)
    with pytest.raises(ValueError, match="already"):
        bm.allocate("a", 1, 1)


def test_slot_layout_is_one_block_per_request():
    bm = BlockManager(num_blocks=3, block_size=128, max_seq_tokens=128)
    for rid in "abc":
        assert len(bm.allocate(rid, 10, 100)) == 1
    assert not bm.can_allocate(1) and bm.free_tokens == 0


def test_bad_geometry_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=40))
def test_blocks_never_shared_and_accounting_adds_up(ops):
    bm = BlockManager(num_blocks=10, block_size=4)
    live: list[str] = []
    for i, (alloc, size) in enumerate(ops):
        if alloc and bm.can_allocate(size):
            bm.allocate(f"r{i}", max(1, size // 2), size)
            live.append(f"r{i}")
        elif live:
            bm.free(live.pop(size % len(live)))
        owned = [b for rid in live for b in bm.block_table(rid)]
        assert len(owned) == len(set(owned))
        assert len(owned) * 4 == bm.reserved_tokens == bm.capacity_tokens - bm.free_tokens


# ---- scheduler ------------------------------------------------------------------------------
def _sched(num_blocks=4, block_size=8, max_running=8, max_waiting=4):
    return Scheduler(BlockManager(num_blocks, block_size), max_running, max_waiting)


def test_fcfs_admission_waits_for_room_without_skipping():
    s = _sched(num_blocks=4, block_size=8)
    s.add("big1", 10, 14)   # 24 tokens -> 3 blocks
    s.add("big2", 10, 14)   # does not fit beside big1
    s.add("small", 2, 2)    # would fit, but must not jump ahead of big2
    out = s.schedule()
    assert out.admitted == ("big1",) and out.request_ids == ("big1",)
    assert out.positions == (10,) and len(out.block_tables[0]) == 3
    assert s.num_waiting == 2
    s.update_from_output(["big1"])
    out = s.schedule()
    assert out.admitted == ("big2", "small")  # big2 takes 3 of 4 blocks, small the last one
    assert out.request_ids == ("big2", "small")


def test_max_running_bounds_the_batch():
    s = _sched(num_blocks=16, max_running=2)
    for i in range(3):
        s.add(f"r{i}", 4, 4)
    assert s.schedule().request_ids == ("r0", "r1") and s.num_waiting == 1


def test_positions_advance_one_per_step():
    s = _sched()
    s.add("a", 5, 3)
    assert [s.schedule().positions for _ in range(3)] == [(5,), (6,), (7,)]


def test_overloaded_when_queue_full_and_too_large_never_queued():
    s = _sched(max_waiting=2)
    s.add("a", 4, 4)
    s.add("b", 4, 4)
    with pytest.raises(Overloaded):
        s.add("c", 4, 4)
    with pytest.raises(RequestTooLarge, match="max_tokens"):
        _sched().add("huge", 30, 10)   # 40 > 32 tokens of capacity
    with pytest.raises(ValueError, match="unique"):
        s.add("a", 1, 1)


def test_abort_waiting_and_running():
    s = _sched()
    s.add("run", 4, 4)
    s.add("wait", 4, 4)
    s.schedule()
    free_before = s.blocks.free_tokens
    assert s.abort("run") and s.blocks.free_tokens > free_before
    assert s.abort("wait") and not s.abort("wait") and not s.has_work


def test_no_waiting_room_still_admits_what_fits_now():
    """max_waiting=0 means: nothing may wait. A request that fits at once is taken; the
    next one, with the pool full, is refused."""
    s = Scheduler(BlockManager(num_blocks=1, block_size=32, max_seq_tokens=32), max_running=4, max_waiting=0)
    s.add("a", 4, 4)
    assert s.schedule().admitted == ("a",)
    with pytest.raises(Overloaded):
        s.add("b", 4, 4)
    s.update_from_output(["a"])
    s.add("b", 4, 4)
    assert s.schedule().admitted == ("b",)


def test_reservations_hold_a_place_until_added_aborted_or_expired():
    s = Scheduler(BlockManager(num_blocks=1, block_size=32, max_seq_tokens=32), max_running=4, max_waiting=1)
    s.add("run", 4, 4)
    assert s.schedule().admitted == ("run",)     # the pool is now full
    s.reserve("r1", 4, 4, now=0.0, ttl_s=10.0)   # takes the one waiting place
    with pytest.raises(Overloaded):
        s.reserve("r2", 4, 4, now=1.0, ttl_s=10.0)
    with pytest.raises(Overloaded):
        s.add("r3", 4, 4)                        # unreserved: no room
    s.add("r1", 4, 4)                            # reserved: always gets in
    assert s.num_waiting == 1
    assert s.abort("r1")
    s.reserve("r4", 4, 4, now=2.0, ttl_s=1.0)
    s.reserve("r5", 4, 4, now=3.5, ttl_s=1.0)    # r4 lapsed at 3.0
    assert s.abort("r5") and not s.abort("r4")
    with pytest.raises(RequestTooLarge):
        s.reserve("big", 30, 10, now=4.0, ttl_s=1.0)


def test_release_reservation_frees_the_held_place():
    s = Scheduler(BlockManager(num_blocks=1, block_size=32, max_seq_tokens=32), max_running=4, max_waiting=1)
    s.add("run", 4, 4)
    s.schedule()
    s.reserve("r1", 4, 4, now=0.0, ttl_s=10.0)
    with pytest.raises(Overloaded):
        s.reserve("r2", 4, 4, now=0.0, ttl_s=10.0)
    assert s.release_reservation("r1") and not s.release_reservation("r1")
    s.reserve("r2", 4, 4, now=0.0, ttl_s=10.0)


# ---- slot compaction ----------------------------------------------------------------------------
def one_block_each(rids: str) -> BlockManager:
    """A manager of len(rids) one-block slots, every one taken by a request of `rids`, in order."""
    bm = BlockManager(num_blocks=len(rids), block_size=8, max_seq_tokens=8)
    for rid in rids:
        bm.allocate(rid, 1, 8)
    return bm


def test_free_blocks_are_handed_out_lowest_first():
    bm = one_block_each("abcd")
    bm.free("c")
    bm.free("a")
    assert bm.allocate("e", 1, 8) == [0] and bm.allocate("f", 1, 8) == [2]


def test_compact_moves_highest_slots_into_holes():
    bm = one_block_each("abcdef")
    bm.free("b")
    bm.free("d")
    assert bm.compact() == [("f", 5, 1), ("e", 4, 3)]
    assert {rid: bm.block_table(rid) for rid in "acef"} == {"a": (0,), "c": (2,), "e": (3,), "f": (1,)}
    assert bm.compact() == [] and bm.allocate("g", 1, 8) == [4]


def test_compact_refuses_the_paged_layout():
    with pytest.raises(ValueError, match="slot layout"):
        BlockManager(num_blocks=4, block_size=8).compact()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60))
def test_compacting_scheduler_rows_are_slots_zero_to_n(ops):
    """Whatever joins and leaves, a compacting plan's row i reads slot i, every running
    request keeps its position, and each move goes from a slot >= n into a hole < n."""
    s = Scheduler(BlockManager(num_blocks=8, block_size=64, max_seq_tokens=64), max_running=8, max_waiting=64,
                  compact=True)
    next_pos: dict[str, int] = {}
    for i, (join, pick) in enumerate(ops):
        if join:
            s.add(f"r{i}", 3, 40)
        elif next_pos:
            gone = sorted(next_pos)[pick % len(next_pos)]
            s.update_from_output([gone])
            del next_pos[gone]
        plan = s.schedule()
        n = plan.batch_size
        assert [t[0] for t in plan.block_tables] == list(range(n))
        assert all(src >= n > dst for _, src, dst in plan.moves)
        for rid, p in zip(plan.request_ids, plan.positions):
            assert p == next_pos.get(rid, 3)
            next_pos[rid] = p + 1
        for rid in [r for r, p in next_pos.items() if p >= 43]:  # reservation used up: finish
            s.update_from_output([rid])
            del next_pos[rid]
