"""n > 1 choices, torch-free parts: the choice seeds, the group's block sharing and reference
counts, admission of n sequences at once, and n on the wire (protos, the KV header)."""
import pytest
import torch

from easerve.engine.block_manager import BlockManager
from easerve.engine.scheduler import Scheduler
from easerve.errors import CodecError, InvalidRequest, Overloaded, RequestTooLarge
from easerve.types import MAX_N, KVPayload, SamplingParams
from easerve.wire.codec import join_parts, kv_from_parts, kv_to_parts, split_parts
from easerve.wire.sampling_proto import sampling_from_proto, sampling_to_proto


def test_n_is_checked_and_choice_i_samples_with_seed_plus_i():
    for bad in (0, -1, MAX_N + 1, 2.0, True):
        with pytest.raises(InvalidRequest, match="^n must be an integer in 1..16"):
            SamplingParams(n=bad)
    sp = SamplingParams(n=3, seed=(1 << 64) - 2, temperature=1.0)
    assert [c.seed for c in map(sp.choice, range(3))] == [(1 << 64) - 2, (1 << 64) - 1, 0]
    assert all(sp.choice(i).n == 1 and sp.choice(i).temperature == 1.0 for i in range(3))
    assert SamplingParams(n=2).choice(1).seed is None
    one = SamplingParams(seed=5)
    assert one.choice(0) is one
    with pytest.raises(ValueError, match="choice 3"):
        sp.choice(3)


def test_a_group_shares_the_prompts_full_blocks_and_owns_the_rest():
    bm = BlockManager(num_blocks=16, block_size=4)
    # prompt 10 tokens: blocks 0-1 full (shared), block 2 partial (copied); reserve 14 -> 4 blocks each
    assert bm.group_blocks(14, 10, 3) == 4 + 2 * 2
    assert bm.can_allocate(14, 10, 3)
    a, b, c = bm.allocate_group(["r#0", "r#1", "r#2"], 10, 14)
    assert a[:2] == b[:2] == c[:2] and len({a[2], b[2], c[2]}) == 3 and len(set(a[2:] + b[2:] + c[2:])) == 6
    assert [bm.refcount(x) for x in a] == [3, 3, 1, 1]
    assert bm.borrowed_tokens("r#0") == 0 and bm.borrowed_tokens("r#1") == bm.borrowed_tokens("r#2") == 8
    assert bm.free_tokens == (16 - 8) * 4
    assert bm.used_tokens == 10 + 2 + 2  # the shared prompt blocks counted once
    assert bm.free("r#0")                # the first to finish leaves the shared blocks to the others
    assert [bm.refcount(x) for x in a[:2]] == [2, 2] and bm.free_tokens == (16 - 6) * 4
    bm.free("r#2")
    bm.free("r#1")
    assert bm.free_tokens == 64 and all(bm.refcount(x) == 0 for x in range(16))


def test_a_group_in_the_slot_layout_shares_nothing():
    bm = BlockManager(num_blocks=4, block_size=32, max_seq_tokens=32)
    assert bm.group_blocks(20, 10, 3) == 3 and not bm.fits_ever(20, 10, 5)
    tables = bm.allocate_group(["x#0", "x#1", "x#2"], 10, 20)
    assert sorted(t[0] for t in tables) == [0, 1, 2] and bm.borrowed_tokens("x#1") == 0
    bm.free("x#0")
    assert bm.compact() == [("x#2", 2, 0)] and bm.refcount(0) == 1 and bm.refcount(2) == 0


def test_scheduler_admits_the_n_sequences_together_and_reserves_for_all():
    s = Scheduler(BlockManager(num_blocks=10, block_size=4), max_running=4, max_waiting=0)
    s.reserve("r", prompt_len=8, max_tokens=4, now=0.0, ttl_s=5.0, n=3)  # 3 + 2 * 1 = 5 blocks
    s.add("r", 8, 4, ("r#0", "r#1", "r#2"))
    plan = s.schedule()
    assert plan.admitted == plan.request_ids == ("r#0", "r#1", "r#2") and plan.positions == (8, 8, 8)
    assert plan.block_tables[0][:2] == plan.block_tables[1][:2] == plan.block_tables[2][:2]
    # 5 blocks left but only one row: a second n=3 request cannot get in now, and no room to wait
    with pytest.raises(Overloaded):
        s.reserve("q", 8, 4, now=0.0, ttl_s=5.0, n=3)
    s.update_from_output(["r#0", "r#1"])
    assert s.abort("r#2") and s.blocks.free_tokens == 40 and not s.has_work


def test_a_group_that_could_never_fit_is_too_large_not_overloaded():
    s = Scheduler(BlockManager(num_blocks=8, block_size=4), max_running=16, max_waiting=4)
    with pytest.raises(RequestTooLarge, match="n = 16 choices"):
        s.reserve("big", prompt_len=4, max_tokens=8, now=0.0, ttl_s=5.0, n=16)  # 3 + 15 * 2 blocks > 8
    few_rows = Scheduler(BlockManager(num_blocks=64, block_size=4), max_running=2, max_waiting=4)
    with pytest.raises(RequestTooLarge, match="runs 2 rows"):
        few_rows.add("r", 4, 4, ("r#0", "r#1", "r#2"))


def test_waiting_group_is_admitted_when_rows_free_fcfs():
    s = Scheduler(BlockManager(num_blocks=32, block_size=4), max_running=3, max_waiting=4)
    s.add("a", 4, 4)
    s.add("g", 4, 4, ("g#0", "g#1", "g#2"))
    s.add("b", 4, 4)
    assert s.schedule().request_ids == ("a",)  # g needs 3 rows; b waits behind it (FCFS)
    s.update_from_output(["a"])
    assert s.schedule().admitted == ("g#0", "g#1", "g#2")
    assert s.abort("g") is False and s.abort("g#1")  # running: by sequence


def test_n_crosses_the_protos_and_the_kv_header():
    sp = SamplingParams(max_tokens=5, temperature=0.7, seed=3, n=4)
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).n == 1
    kv = [torch.zeros(2, 3, 4)]
    p = KVPayload("r", kv, kv, 3, 0, 11, sp, first_tokens=[11, 12, 13, 14])
    back = kv_from_parts(*split_parts(join_parts(*kv_to_parts(p))))
    assert back.first_tokens == [11, 12, 13, 14] and back.choice_tokens == [11, 12, 13, 14] and back.sampling.n == 4
    assert KVPayload("r", kv, kv, 3, 0, 11, SamplingParams()).choice_tokens == [11]
    bad = KVPayload("r", kv, kv, 3, 0, 11, sp, first_tokens=[11, 12])
    with pytest.raises(CodecError, match="2 first tokens for n = 4"):
        kv_from_parts(*split_parts(join_parts(*kv_to_parts(bad))))


def test_the_sdk_collects_each_choice_by_index():
    from easerve.client import Chunk, Usage, collect_choices
    chunks = [Chunk("a", (1,), index=0), Chunk("x", (5,), index=1), Chunk("y", (6,), "length", index=1),
              Chunk("b", (2,), "stop", Usage(7, 4), index=0)]
    first, second = collect_choices(chunks, 2)
    assert (first.text, first.token_ids, first.finish_reason) == ("ab", (1, 2), "stop")
    assert (second.text, second.token_ids, second.finish_reason) == ("xy", (5, 6), "length")
    assert first.usage == second.usage == Usage(7, 4)
