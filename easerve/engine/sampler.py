"""Batched sampling with per-request parameters.

Greedy rows take the argmax. Unseeded random rows are sampled together with torch's global
RNG. Seeded rows are sampled one by one on the CPU with a generator seeded from
(seed, step), so a seeded request draws the same tokens whatever batch it sits in and
whichever device runs the model. Before any of it, the request's logit transforms
(`logit_transforms.apply`: logit_bias, min_tokens, penalties) change the logits of greedy and
sampled rows alike. Filters follow vLLM's order: temperature, min_p, then top-k, then top-p
(nucleus, always keeping the most likely token).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from easerve.engine import logit_transforms
from easerve.engine.logit_transforms import TokenHistory
from easerve.types import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): decorrelated seeds for consecutive steps, in [0, 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] float logits -> temperature-scaled logits with -inf outside top-k / top-p."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                         device=dev, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = torch.arange(vocab, device=dev)[None, :] < top_k[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generator: torch.Generator | None = None) -> torch.Tensor:
    probs = filtered_logits(logits.float(), params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           histories: Sequence[TokenHistory | None] | None = None) -> list[int]:
    """logits [B, V] (row i belongs to params[i]; steps[i] is how many tokens that request
    has sampled before, 0 for prefill's first token; histories[i] its `TokenHistory`, needed
    when params[i].transforms_logits) -> one token id per row."""
    if not (logits.shape[0] == len(params) == len(steps)):
        raise ValueError(f"logits rows {logits.shape[0]}, params {len(params)}, steps {len(steps)} must match")
    if any(p.transforms_logits for p in params):
        if histories is None or any(h is None for p, h in zip(params, histories) if p.transforms_logits):
            raise ValueError("a request with penalties, logit_bias or min_tokens needs its TokenHistory")
        logits = logit_transforms.apply(logits, params, steps, histories)
    out = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return out.tolist()
    unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=logits.device)
        out[idx] = _sample_rows(logits[idx], [params[i] for i in unseeded])
    tokens = out.tolist()
    for i, p in enumerate(params):
        if not p.greedy and p.seed is not None:
            gen = torch.Generator().manual_seed(mix_seed(p.seed, steps[i]))
            tokens[i] = int(_sample_rows(logits[i:i + 1].cpu(), [p], gen)[0])
    return tokens
