"""n > 1 choices in the decode engine (one prefill, n sequences sharing the prompt's KV) on
real tiny models: greedy choices equal one another and a single greedy run in both KV layouts;
the shared prompt blocks are reference-counted and every block is free once all n finish;
seeded choice i draws what an n = 1 request with seed + i draws, through the real prefill loop,
the KV codec and a fresh engine; each choice keeps its own grammar state."""
from __future__ import annotations

import json

import pytest
import torch

from easerve.engine.config import EngineConfig
from easerve.engine.detok import prompt_tail
from easerve.engine.engine import DecodeEngine
from easerve.engine.logit_transforms import TokenHistory, penalty_prompt_ids
from easerve.engine.sampler import sample
from easerve.types import KVPayload, PrefillRequest, SamplingParams, StructuredOutput
from easerve.wire.codec import join_parts, kv_from_parts, kv_to_parts, split_parts
from tests.models.text_lm import prefill_once
from tests.models.text_lm import greedy_ignore_eos

torch.set_num_threads(1)
FAMILY = "qwen2.5-vl"
IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 13 tokens: one full block of 8 and a partial one


def fork_payload(adapter, rid: str, ids: list[int], sp: SamplingParams) -> KVPayload:
    """What prefill hands over for n choices: the prompt KV once, choice i's first token sampled
    with sp.choice(i)."""
    res = adapter.prefill_ids(rid, ids)
    firsts = [sample(res.last_logits[None], [sp.choice(i)], [0],
                     [TokenHistory.start(sp.choice(i), ids, adapter.eos_token_ids)])[0] for i in range(sp.n)]
    return KVPayload(rid, res.keys, res.values, res.prompt_len, res.rope_delta, firsts[0], sp,
                     prompt_ids_tail=prompt_tail(ids), first_tokens=firsts if sp.n > 1 else [])


def run(engine: DecodeEngine, payload: KVPayload, watch=None) -> dict[int, list[int]]:
    """Every choice's tokens (prefill's first included) until the request ends."""
    engine.add(payload)
    got: dict[int, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            if o.token_id is not None:
                got.setdefault(o.choice, []).append(o.token_id)
        if watch is not None:
            watch(engine)
    return got


@pytest.mark.parametrize("kv", [dict(kv_capacity_tokens=160, block_size=8), dict(num_slots=4, max_seq_len=40)])
def test_greedy_choices_equal_one_another_and_a_single_run(llama, ref, kv):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, **kv))
    sp = SamplingParams(max_tokens=10, ignore_eos=True, n=3)
    seen = []

    def watch(e):
        if not seen:  # after the step that admitted the three choices
            tables = [e.blocks.block_table(f"g#{i}") for i in range(3)]
            seen.append([e.blocks.refcount(t[0]) for t in tables])
            seen.append(len({t[0] for t in tables}))
    got = run(engine, fork_payload(llama, "g", IDS, sp), watch)
    want = greedy_ignore_eos(ref, IDS, 10)
    assert got == {0: want, 1: want, 2: want}
    if engine.backend == "slots":  # one slot a choice, each with its own copy of the prompt
        assert seen == [[1, 1, 1], 3]
    else:                          # the full prompt block shared by all three
        assert seen == [[3, 3, 3], 1]
    s = engine.stats()
    assert s.kv_free_tokens == s.kv_capacity_tokens and (s.running, s.waiting) == (0, 0)


def test_seeded_choice_i_draws_what_seed_plus_i_draws_alone(llama):
    cfg = EngineConfig(max_running=4, kv_capacity_tokens=160, block_size=8)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, n=3)
    got = run(DecodeEngine(llama, cfg), fork_payload(llama, "s", IDS, sp))
    alone = {i: run(DecodeEngine(llama, cfg), fork_payload(llama, f"a{i}", IDS, sp.choice(i)))[0] for i in range(3)}
    assert got == alone
    assert len({tuple(t) for t in got.values()}) == 3  # the choices differ


def test_choices_done_on_their_first_token_free_everything_and_abort_ends_each_choice(llama):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, kv_capacity_tokens=160, block_size=8))
    engine.reserve("one", len(IDS), 1, n=3)
    out = run(engine, fork_payload(llama, "one", IDS, SamplingParams(max_tokens=1, n=3)))
    assert sorted(out) == [0, 1, 2] and all(len(t) == 1 for t in out.values())
    assert not engine.scheduler.release_reservation("one") and engine.stats().kv_free_tokens == 160
    engine.add(fork_payload(llama, "ab", IDS, SamplingParams(max_tokens=20, ignore_eos=True, n=3)))
    engine.step()
    assert engine.stats().running == 3 and engine.abort("ab")
    outs = engine.step()
    assert sorted((o.choice, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert engine.stats().kv_free_tokens == 160 and not engine.has_work


# ---- through the real prefill loop and the KV codec (the tiny qwen2.5-vl, an image prompt) ----------
@pytest.fixture(scope="module")
def image_req(mixed_requests):
    return mixed_requests(FAMILY)[0]


@pytest.fixture(scope="module")
def dec(adapters):
    return adapters(FAMILY, "decode")


def split_choices(pre, dec, req: PrefillRequest, sp: SamplingParams) -> dict[int, list[int]]:
    """Prefill loop (n first tokens) -> codec bytes -> a fresh DecodeEngine: each choice's tokens."""
    one = prefill_once(pre, req, sp)
    r = one.result
    assert len(one.first_tokens) == sp.n
    payload = KVPayload(req.request_id, r.keys, r.values, r.prompt_len, r.rope_delta, one.first_token, sp,
                        prompt_ids_tail=prompt_tail(req.input_ids), penalty_ids=penalty_prompt_ids(sp, req.input_ids),
                        first_tokens=list(one.first_tokens) if sp.n > 1 else [])
    wire = kv_from_parts(*split_parts(join_parts(*kv_to_parts(payload))))
    engine = DecodeEngine(dec, EngineConfig(max_running=4, num_slots=4, max_seq_len=r.prompt_len + sp.max_tokens + 4))
    return run(engine, wire)


def test_seeded_choices_through_prefill_repeat_and_match_seed_plus_i(pre, dec, image_req):
    sp = SamplingParams(max_tokens=6, temperature=1.0, top_k=40, seed=99, ignore_eos=True, n=3)
    got = split_choices(pre, dec, image_req, sp)
    assert split_choices(pre, dec, image_req, sp) == got
    assert len({tuple(t) for t in got.values()}) == 3
    for i in range(3):
        assert split_choices(pre, dec, image_req, sp.choice(i))[0] == got[i]
    greedy = split_choices(pre, dec, image_req, SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    assert greedy[0] == greedy[1] == split_choices(pre, dec, image_req, SamplingParams(max_tokens=6, ignore_eos=True))[0]


def test_each_choice_keeps_its_own_grammar_state(pre, dec, image_req):
    words = ["red", "green", "blue", "violet"]
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4,
                        structured=StructuredOutput("choice", json.dumps(words)))
    got = split_choices(pre, dec, image_req, sp)
    texts = [dec.tokenizer.decode(got[i], skip_special_tokens=True) for i in range(4)]
    assert all(t in words for t in texts), texts
