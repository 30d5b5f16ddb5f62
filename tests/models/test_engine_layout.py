"""The engine's KV layouts on a real tiny HF decoder: slots read in place and compacted on
finish, memory sizing, failed steps, and reservations of requests done on their first token."""
import random

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.models.text_lm import greedy_ignore_eos, payload_for

from easerve.engine import attention as att
from easerve.engine.config import GIB
from easerve.engine.config import EngineConfig
from easerve.engine.engine import DecodeEngine
from easerve.errors import Overloaded, RequestTooLarge
from easerve.engine.kv_pool import KVLayout
from easerve.types import SamplingParams

torch.set_num_threads(1)


def _sp(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_slots_compact_on_finish_and_every_request_matches_generate(llama, ref):
    """Requests of different lengths join over time and finish out of order (one is aborted);
    every step's batch is slots 0..n-1, and each request's tokens == the model's own decode."""
    engine = DecodeEngine(llama, EngineConfig(max_running=5, max_waiting=32, num_slots=5, max_seq_len=48))
    assert engine.backend == "slots"
    rng = random.Random(3)
    reqs = {f"s{i}": ([rng.randrange(3, 320) for _ in range(rng.randrange(2, 20))], rng.randrange(1, 20))
            for i in range(14)}
    arrivals = {}
    for rid, (ids, n) in reqs.items():
        arrivals.setdefault(rng.randrange(0, 15), []).append(payload_for(llama, rid, ids, _sp(n)))
    got: dict[str, list[int]] = {}
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    for step in range(200):
        for p in arrivals.get(step, []):
            engine.add(p)
        if step == 6:  # abort whoever sits in slot 0: a hole at the bottom
            aborted = plans[-1].request_ids[0]
            assert engine.abort(aborted)
        for o in engine.step():
            if o.token_id is not None:
                got.setdefault(o.request_id, []).append(o.token_id)
        plan = plans[-1]  # compaction happens when a step is planned: row i reads slot i
        assert [t[0] for t in plan.block_tables] == list(range(plan.batch_size))
        if not engine.has_work and step > max(arrivals):
            break
    assert sum(len(p.moves) for p in plans) > 0  # the scenario really exercised compaction
    for rid, (ids, n) in reqs.items():
        want = greedy_ignore_eos(ref, ids, n)
        assert got[rid] == (want[:len(got[rid])] if rid == aborted else want), rid
    assert engine.stats().kv_free_tokens == engine.stats().kv_capacity_tokens


def test_slot_attention_reads_the_pool_in_place(llama, monkeypatch):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, num_slots=4, max_seq_len=64))
    seen = []
    real = att.SlotStepCache.update

    def spy(self, *a, **k):
        k_, v_ = real(self, *a, **k)
        seen.append((k_.untyped_storage().data_ptr(), v_.untyped_storage().data_ptr(), tuple(k_.shape)))
        return k_, v_
    monkeypatch.setattr(att.SlotStepCache, "update", spy)
    engine.add(payload_for(llama, "a", [3, 4, 5, 6, 7], _sp(4)))
    engine.add(payload_for(llama, "b", [8, 9], _sp(4)))
    engine.step()
    pool_ptr = engine.pool.kv.untyped_storage().data_ptr()
    assert seen and all(k == v == pool_ptr for k, v, _ in seen)
    assert seen[0][2] == (2, 2, 6, 16)  # [rows, kv_heads, longest length, head_dim]


def test_decode_sdpa_equals_hf_sdpa():
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for heads, kv_heads in ((8, 2), (4, 4)):
        module.num_key_value_groups = heads // kv_heads
        q = torch.randn(3, heads, 1, 16, generator=gen)
        k, v = (torch.randn(3, kv_heads, 9, 16, generator=gen) for _ in range(2))
        mask = att.length_mask([8, 3, 5], torch.tensor([8, 3, 5]), 9)
        for m in (mask, None):
            want, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.3)
            got, _ = att.decode_sdpa(module, q, k, v, m, scaling=0.3)
            torch.testing.assert_close(got, want)


def test_paged_layout_still_matches_generate(llama, ref):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, kv_capacity_tokens=160, block_size=8))
    assert engine.backend == "paged-gather"
    reqs = {"p0": ([5, 6, 7, 8, 9, 10, 11], 12), "p1": ([40, 41], 5), "p2": ([70] * 13, 9)}
    for rid, (ids, n) in reqs.items():
        engine.add(payload_for(llama, rid, ids, _sp(n)))
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o.token_id)
    assert got == {rid: greedy_ignore_eos(ref, ids, n) for rid, (ids, n) in reqs.items()}


def test_memory_sized_engine(llama, ref):
    per_token = KVLayout.from_text_config(llama.text_config, llama.dtype, "cpu").bytes_per_token
    cfg = EngineConfig(max_running=8, kv_cache_memory_gb=(3 * 40 * per_token + 7) / GIB, max_seq_len=40)
    engine = DecodeEngine(llama, cfg)
    s = engine.stats()
    assert engine.backend == "slots" and s.kv_capacity_tokens == 120 and s.kv_bytes == 120 * per_token
    with pytest.raises(RequestTooLarge, match="max_tokens"):
        engine.add(payload_for(llama, "big", [3] * 10, _sp(31)))
    engine.add(payload_for(llama, "ok", [3] * 10, _sp(30)))
    got = []
    while engine.has_work:
        got += [o.token_id for o in engine.step()]
    assert got == greedy_ignore_eos(ref, [3] * 10, 30)
    with pytest.raises(ValueError, match="raise --kv-cache-memory-gb"):
        DecodeEngine(llama, EngineConfig(kv_cache_memory_gb=39 * per_token / GIB, max_seq_len=40))


def test_first_token_finish_gives_back_its_reservation(llama):
    engine = DecodeEngine(llama, EngineConfig(max_running=1, max_waiting=1, num_slots=1, max_seq_len=32))
    engine.add(payload_for(llama, "busy", [3, 4], _sp(20)))
    engine.step()                                       # the only slot is taken
    engine.reserve("done", prompt_len=2, max_tokens=1)  # the one waiting place
    with pytest.raises(Overloaded):
        engine.reserve("next", prompt_len=2, max_tokens=4)
    engine.add(payload_for(llama, "done", [5, 6], _sp(1)))  # finishes on prefill's token
    out = engine.step()
    assert [(o.index, o.finish_reason) for o in out if o.request_id == "done"] == [(0, "length")]
    engine.reserve("next", prompt_len=2, max_tokens=4)  # the place came back


class _Boom(RuntimeError):
    pass


def test_a_failing_forward_propagates_and_leaves_the_engine_consistent(llama, ref):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, num_slots=4, max_seq_len=64))
    fail = {"on": False}

    def hook(module, args):
        if fail["on"]:
            raise _Boom("injected forward failure")
    handle = llama.lm.layers[1].register_forward_pre_hook(hook)
    try:
        reqs = {"a": ([5, 6, 7], 10), "b": ([9, 8, 7, 6], 8), "c": ([11, 12], 6)}
        got: dict[str, list[int]] = {}

        def collect(outs):
            for o in outs:
                got.setdefault(o.request_id, []).append(o.token_id)
        for rid in "ab":
            engine.add(payload_for(llama, rid, reqs[rid][0], _sp(reqs[rid][1])))
        collect(engine.step())
        collect(engine.step())
        engine.add(payload_for(llama, "c", reqs["c"][0], _sp(reqs["c"][1])))  # admitted by the failing step
        fail["on"] = True
        for _ in range(2):
            with pytest.raises(_Boom):
                engine.step()
        assert engine.stats().running == 3 and engine.stats().kv_used_tokens == 3 + 4 + 2 + 2 * 2
        fail["on"] = False
        while engine.has_work:        # the failed steps left nothing half done: decoding resumes exactly
            collect(engine.step())
        assert got == {rid: greedy_ignore_eos(ref, ids, n) for rid, (ids, n) in reqs.items()}

        # fail again, then abort everything: the pool is fully free
        for rid, (ids, n) in reqs.items():
            engine.add(payload_for(llama, f"{rid}2", ids, _sp(n)))
        engine.step()
        fail["on"] = True
        with pytest.raises(_Boom):
            engine.step()
        assert all(engine.abort(f"{rid}2") for rid in reqs)
        fail["on"] = False
        outs = engine.step()
        assert sorted(o.request_id for o in outs if o.finish_reason == "abort") == ["a2", "b2", "c2"]
        s = engine.stats()
        assert (s.running, s.waiting, s.kv_free_tokens) == (0, 0, s.kv_capacity_tokens) and not engine.has_work
    finally:
        handle.remove()


@pytest.mark.parametrize("kv", [dict(num_slots=2, max_seq_len=48), dict(kv_capacity_tokens=96, block_size=16)])
def test_steady_batch_reuses_inputs_but_never_across_a_new_request(llama, ref, kv):
    """A batch unchanged since the last step feeds back its sampled tokens; an id aborted and
    added again with another prompt must not inherit the old request's inputs."""
    engine = DecodeEngine(llama, EngineConfig(max_running=2, **kv))
    engine.add(payload_for(llama, "a", [5, 6, 7], _sp(20)))
    engine.add(payload_for(llama, "b", [30, 31], _sp(8)))
    got = {"a": [], "b": []}
    for _ in range(4):
        for o in engine.step():
            got[o.request_id].append(o.token_id)
    assert engine.abort("a")
    engine.add(payload_for(llama, "a", [90, 91, 92, 93], _sp(6)))
    got["a"] = []
    while engine.has_work:
        for o in engine.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
    assert got == {"a": greedy_ignore_eos(ref, [90, 91, 92, 93], 6), "b": greedy_ignore_eos(ref, [30, 31], 8)}
