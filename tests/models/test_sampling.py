"""vLLM's sampling options through the real split path: prefill's batching loop samples the
first token, the KV payload crosses the codec, a fresh DecodeEngine continues. Seeded
penalised runs repeat on any engine instance; penalties at decode see the prompt; logit_bias
and min_tokens hold from the first token on; greedy repetition_penalty equals transformers'
own generate (with min_new_tokens as min_tokens)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from easerve.engine.detok import prompt_tail
from easerve.engine.config import EngineConfig
from easerve.engine.engine import DecodeEngine
from easerve.engine.logit_transforms import penalty_prompt_ids
from easerve.types import KVPayload, PrefillRequest, SamplingParams
from easerve.wire.codec import join_parts, kv_from_parts, kv_to_parts, split_parts
from tests.models.text_lm import TextLMSpec, build_text_lm, greedy_ignore_eos, payload_for, prefill_once

torch.set_num_threads(1)
FAMILY = "qwen2.5-vl"

@pytest.fixture(scope="module")
def image_req(mixed_requests):
    return mixed_requests(FAMILY)[0]  # an image and a few words

@pytest.fixture(scope="module")
def dec(adapters):
    return adapters(FAMILY, "decode")

def over_the_wire(payload):
    """The KV payload as decode receives it: framed to bytes by the codec and parsed back."""
    return kv_from_parts(*split_parts(join_parts(*kv_to_parts(payload))))

def split_outputs(pre, dec, req: PrefillRequest, sp: SamplingParams) -> list:
    """Prefill loop -> codec bytes -> a new DecodeEngine: the engine's StepOutputs with a token."""
    one = prefill_once(pre, req, sp)
    r = one.result
    prompt = sp.prompt_ids(req.input_ids)  # as prefill's stage: a resumed request's earlier tokens replay from sp
    payload = KVPayload(req.request_id, r.keys, r.values, r.prompt_len, r.rope_delta, one.first_token, sp,
                        prompt_ids_tail=prompt_tail(prompt), penalty_ids=penalty_prompt_ids(sp, prompt))
    engine = DecodeEngine(dec, EngineConfig(max_running=2, num_slots=2, max_seq_len=r.prompt_len + sp.max_tokens + 4))
    engine.add(over_the_wire(payload))
    outs = []
    while engine.has_work:
        outs += [o for o in engine.step() if o.token_id is not None]
    return outs

def split_run(pre, dec, req: PrefillRequest, sp: SamplingParams) -> tuple[list[int], str]:
    """`split_outputs`' (tokens, finish reason)."""
    outs = split_outputs(pre, dec, req, sp)
    return [o.token_id for o in outs], outs[-1].finish_reason

@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["seeded", "greedy"])
def test_a_resumed_request_goes_on_as_if_uninterrupted(pre, dec, image_req, temperature):
    """The gateway's mid-stream migration: prefill of prompt + the first 5 tokens with those
    tokens as `resumed` gives the same next tokens and the same text (a stop string's held-back
    text crosses the cut) as the run that was never cut; penalties and the seed's steps too."""
    sp = SamplingParams(max_tokens=12, temperature=temperature, top_k=40, seed=77, repetition_penalty=1.3,
                        presence_penalty=0.4, ignore_eos=True, stop=("never-in-this-text",))
    whole = [(o.token_id, o.text_delta) for o in split_outputs(pre, dec, image_req, sp)]
    assert len(whole) == 12
    k, ids = 5, [t for t, _ in whole]
    cut = PrefillRequest(image_req.request_id, [*image_req.input_ids, *ids[:k]], image_req.embeddings,
                         image_req.items_meta, dataclasses.replace(sp, resumed=tuple(ids[:k])))
    rest = split_outputs(pre, dec, cut, cut.sampling)
    assert [(o.token_id, o.text_delta) for o in rest] == whole[k:]
    assert [o.index for o in rest] == list(range(12 - k))  # index 0: this leg's prefill token

def test_seeded_repetition_penalised_run_repeats_on_a_fresh_engine(pre, dec, image_req):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=1234, repetition_penalty=1.8,
                        presence_penalty=0.5, ignore_eos=True)
    first, reason = split_run(pre, dec, image_req, sp)
    assert len(first) == 10 and reason == "length"
    assert split_run(pre, dec, image_req, sp)[0] == first
    plain = split_run(pre, dec, image_req, SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=1234,
                                                          ignore_eos=True))[0]
    assert plain != first  # the penalties changed the draw; the seed alone repeats it

def test_logit_bias_forces_every_greedy_token(pre, dec, image_req):
    forced = 42
    assert forced not in dec.eos_token_ids
    tokens, reason = split_run(pre, dec, image_req, SamplingParams(max_tokens=6, logit_bias={forced: 100}))
    assert tokens == [forced] * 6 and reason == "length"

def test_min_tokens_holds_eos_back_from_prefill_on(pre, dec, image_req):
    eos = dec.eos_token_ids[0]
    sp = SamplingParams(max_tokens=8, min_tokens=3, logit_bias={eos: 100})  # eos wins once allowed
    tokens, reason = split_run(pre, dec, image_req, sp)
    assert eos not in tokens[:3] and tokens[3] == eos and len(tokens) == 4 and reason == "stop"

@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_equals_transformers_generate(penalty):
    adapter = build_text_lm(TextLMSpec(family="llama", seed=2))
    ref = copy.deepcopy(adapter)  # the engine switches the original's attention
    base = [5, 9, 9, 17, 30, 5, 41, 17]
    ids = base + greedy_ignore_eos(ref, base, 8)  # a prompt holding the tokens this model likes next
    sp = SamplingParams(max_tokens=12, min_tokens=12, repetition_penalty=penalty)  # min_new_tokens below
    engine = DecodeEngine(adapter, EngineConfig(max_running=2, num_slots=2, max_seq_len=40))
    engine.add(over_the_wire(payload_for(adapter, "r", ids, sp)))  # the prompt ids cross the codec
    engine.add(payload_for(adapter, "plain", ids, SamplingParams(max_tokens=12, ignore_eos=True)))  # a neighbour
    outs: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
    want = ref.causal_lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0,
                                  repetition_penalty=penalty)[0, len(ids):].tolist()
    assert outs["r"] == want
    assert outs["plain"] != want  # the penalty matters on this prompt
