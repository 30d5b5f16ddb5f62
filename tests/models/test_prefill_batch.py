"""Batched prefill (one packed LM forward for several requests) equals one request at a time,
for every family: first tokens, KV, logits, positions, and greedy decode continued from the KV,
with prompts of different lengths and media counts (and a text-only one) in one batch."""
from __future__ import annotations

import pytest
import torch

from easerve.types import PrefillRequest

FAMILIES = ("llava-next", "qwen2.5-vl", "qwen2-audio", "ultravox")
KV_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_batched_equals_one_at_a_time(adapters, mixed_requests, decode_greedy, family):
    pre, reqs = adapters(family, "prefill"), mixed_requests(family)
    assert len({len(r.input_ids) for r in reqs}) == len(reqs), "the batch must mix prompt lengths"
    assert any(not r.embeddings for r in reqs) and any(r.embeddings for r in reqs)
    batched = pre.prefill(reqs)
    cfg = pre.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for req, got in zip(reqs, batched):
        ref = pre.prefill_one(req)
        assert got.request_id == req.request_id
        assert (got.prompt_len, got.rope_delta) == (ref.prompt_len, ref.rope_delta) == (len(req.input_ids),
                                                                                          ref.rope_delta)
        assert int(got.last_logits.argmax()) == int(ref.last_logits.argmax())
        torch.testing.assert_close(got.last_logits, ref.last_logits, **KV_TOL)
        assert len(got.keys) == len(got.values) == cfg.num_hidden_layers
        for gk, gv, rk, rv in zip(got.keys, got.values, ref.keys, ref.values):
            assert gk.shape == gv.shape == (cfg.num_key_value_heads, len(req.input_ids), head_dim)
            assert gk.is_contiguous() and gv.is_contiguous()
            torch.testing.assert_close(gk, rk, **KV_TOL)
            torch.testing.assert_close(gv, rv, **KV_TOL)
        assert decode_greedy(pre, got) == decode_greedy(pre, ref)


def test_qwen_rope_deltas_differ_within_one_batch(adapters, mixed_requests):
    """M-RoPE: image, video and text-only requests in one batch each keep their own delta."""
    pre = adapters("qwen2.5-vl", "prefill")
    deltas = [r.rope_delta for r in pre.prefill(mixed_requests("qwen2.5-vl"))]
    assert deltas[2] == 0 and len(set(deltas)) >= 3
    assert pre.model.model.rope_deltas is None


def test_batch_order_does_not_change_results(adapters, mixed_requests):
    pre, reqs = adapters("llava-next", "prefill"), mixed_requests("llava-next")
    forward = {r.request_id: r for r in pre.prefill(reqs)}
    backward = {r.request_id: r for r in pre.prefill(reqs[::-1])}
    for rid, res in forward.items():
        torch.testing.assert_close(res.last_logits, backward[rid].last_logits, **KV_TOL)
        torch.testing.assert_close(res.keys[-1], backward[rid].keys[-1], **KV_TOL)


def test_one_request_takes_the_exact_path(adapters, mixed_requests):
    pre, (req, *_) = adapters("qwen2-audio", "prefill"), mixed_requests("qwen2-audio")
    (got,), ref = pre.prefill([req]), pre.prefill_one(req)
    assert torch.equal(got.last_logits, ref.last_logits)
    assert all(torch.equal(a, b) for a, b in zip(got.keys, ref.keys))
    assert pre.prefill([]) == []


def test_a_bad_request_fails_the_batch_before_the_forward(adapters, mixed_requests):
    pre, reqs = adapters("qwen2.5-vl", "prefill"), mixed_requests("qwen2.5-vl")
    bad = PrefillRequest("bad", reqs[0].input_ids, [], [])  # placeholders without embeddings
    with pytest.raises(ValueError, match="request bad: the prompt has .* image placeholder"):
        pre.prefill([reqs[1], bad])
    with pytest.raises(ValueError, match="request bad: .*2 embeddings for 1 media items"):
        pre.check_prefill(PrefillRequest("bad", reqs[0].input_ids, reqs[0].embeddings * 2, reqs[0].items_meta))
    with pytest.raises(ValueError, match="empty prompt"):
        pre.prefill([reqs[1], PrefillRequest("bad", [], [], [])])


def test_sdpa_adapters_prefill_with_per_prompt_attention(adapters):
    from easerve.models.batched_prefill import ATTN_IMPL

    for family in FAMILIES:
        assert adapters(family, "prefill").language_model.config._attn_implementation == ATTN_IMPL


@pytest.mark.parametrize("how", ["eager", "engine"])
def test_mask_fallback_equals_one_at_a_time(tiny_checkpoint, mixed_requests, decode_greedy, how):
    """LMs not on the packed attention (eager; or switched to the decode engine's attention,
    as in the in-process pipeline) get a block-diagonal mask and the same results."""
    from easerve.engine.attention import ATTN_IMPL as ENGINE_ATTN, use_engine_attention
    from easerve.models.registry import adapter_class

    cls = adapter_class("qwen2.5-vl")
    pre = cls(str(tiny_checkpoint("qwen2.5-vl")), role="prefill",
              attn_implementation="eager" if how == "eager" else "sdpa")
    if how == "engine":
        use_engine_attention(pre.language_model)
    assert pre.language_model.config._attn_implementation == ("eager" if how == "eager" else ENGINE_ATTN)
    reqs = mixed_requests("qwen2.5-vl")
    for req, got in zip(reqs, pre.prefill(reqs)):
        ref = pre.prefill_one(req)
        torch.testing.assert_close(got.last_logits, ref.last_logits, **KV_TOL)
        torch.testing.assert_close(got.keys[-1], ref.keys[-1], **KV_TOL)
        assert decode_greedy(pre, got) == decode_greedy(pre, ref)
