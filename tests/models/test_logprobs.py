"""Logprobs of the decode engine and of prefill's first token equal the model's own
log_softmax at each position (HF generate's logits), for greedy and sampled requests."""
from __future__ import annotations

import copy

import pytest
import torch

from easerve.engine.config import EngineConfig

from easerve.engine.engine import DecodeEngine
from easerve.engine.logprobs import token_logprobs
from easerve.types import SamplingParams
from tests.models.text_lm import TextLMSpec, build_text_lm, payload_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    adapter = build_text_lm(TextLMSpec(family="llama", seed=4))
    return adapter, copy.deepcopy(adapter)  # the engine switches the original's attention


def _hf_steps(ref, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the unsplit model's logits at each output position, teacher-forced."""
    full = torch.tensor([ids + tokens[:-1]])
    with torch.no_grad():
        logits = ref.causal_lm(full).logits[0, len(ids) - 1:]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),
                                      SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0, temperature=0.9,
                                                     seed=7)])
def test_engine_logprobs_are_the_models_distribution(lm, sampling):
    adapter, ref = lm
    engine = DecodeEngine(adapter, EngineConfig(max_running=4, num_slots=4, max_seq_len=64))
    ids = list(range(10, 22))
    plain = payload_for(adapter, "plain", ids, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add(payload_for(adapter, "r", ids, sampling))
    engine.add(plain)  # a neighbour that asks for none: it gets none, and changes nothing
    outs = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    mine = outs["r"]
    assert all(o.logprobs is None for o in outs["plain"])
    assert mine[0].logprobs is None  # index 0 is prefill's token: prefill reports its logprobs
    tokens = [o.token_id for o in mine]
    want = _hf_steps(ref, ids, tokens)
    for k, o in enumerate(mine[1:], start=1):
        lp = o.logprobs
        assert lp.logprob == pytest.approx(float(want[k, o.token_id]), abs=1e-4)
        assert len(lp.top) == sampling.logprobs
        top_v, top_i = want[k].topk(max(sampling.logprobs, 1))
        assert [t for t, _ in lp.top] == top_i[:sampling.logprobs].tolist()
        assert all(v == pytest.approx(float(w), abs=1e-4) for (_, v), w in zip(lp.top, top_v))
        assert lp.logprob <= 0


def test_first_token_logprobs_from_prefill_logits(lm):
    adapter, ref = lm
    ids = list(range(30, 41))
    res = adapter.prefill_ids("p", ids, None)
    first = int(res.last_logits.argmax())
    (lp,) = token_logprobs(res.last_logits[None], [first], [2])
    want = _hf_steps(ref, ids, [first])[0]
    assert lp.logprob == pytest.approx(float(want.max()), abs=1e-4) and lp.top[0][0] == first
    assert token_logprobs(res.last_logits[None], [first], [None]) == [None]
