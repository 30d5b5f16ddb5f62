"""Warm-up work each stage runs before it reports SERVING: one real forward through
the same code path as a request, so the first client does not pay for lazy
initialisation (kernels, allocator, thread pools)."""
from __future__ import annotations

from easerve.engine.detok import prompt_tail
from easerve.types import KVPayload, PrefillRequest, SamplingParams

_PROMPT = "Hello, warm up."


def dummy_prefill_request(adapter, request_id: str = "warmup", max_tokens: int = 2) -> PrefillRequest:
    ids = adapter.tokenizer(_PROMPT)["input_ids"]
    return PrefillRequest(request_id, list(ids), [], [], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prefill_once(adapter) -> None:
    adapter.prefill([dummy_prefill_request(adapter)])


def dummy_payload(adapter, request_id: str = "__warmup__") -> KVPayload:
    """A short prefilled request for the decode engine (built with the decode role's LM)."""
    req = dummy_prefill_request(adapter, request_id, max_tokens=3)
    res = adapter.prefill([req])[0]
    return KVPayload(request_id, res.keys, res.values, res.prompt_len, res.rope_delta,
                     int(res.last_logits.argmax()), req.sampling, prompt_ids_tail=prompt_tail(req.input_ids))
