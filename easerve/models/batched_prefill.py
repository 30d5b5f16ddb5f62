"""Tensor plumbing of batched prefill: several prompts of different lengths in one LM forward.

Layout: packing. The prompts are laid end to end in ONE row of S = sum(T_b) tokens (no
padding, so the linear layers compute exactly the real tokens); each prompt keeps its own
positions (restarting at 0; Qwen2.5-VL's M-RoPE rows come from its own `get_rope_index`),
and every token attends only to the earlier tokens of its own prompt. So each prompt's
tokens compute what a one-prompt forward computes (up to float summation order).

Attention, two ways:
- `ATTN_IMPL` ("easerve_packed", registered by `register()`; adapters loaded with
  attn_implementation="sdpa" switch their LM to it) is sdpa, except that when the forward
  carries `SEGMENTS_KWARG` (the (start, end) of every prompt) it runs causal sdpa on each
  prompt's slice: varlen attention, sum(T_b^2) work instead of S^2.
- Any other implementation (eager, or the decode engine's "easerve" after it switched the
  LM) gets a block-diagonal causal 4-D mask from transformers' own `create_causal_mask`
  with a "same segment" AND-term, in that implementation's mask format.

`HFAdapter.prefill` uses these; each family only supplies its per-request positions
(`prefill_positions`: [1, T] for 1-D RoPE, [4, 1, T] for Qwen2.5-VL's M-RoPE).
"""
from __future__ import annotations

import torch

from easerve.types import PrefillResult

ATTN_IMPL = "easerve_packed"
SEGMENTS_KWARG = "easerve_segments"


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa; with `SEGMENTS_KWARG` = [(start, end), ...] over a packed row, causal sdpa per
    segment (query/key/value [1, heads, S, d]; output [1, S, heads, d] like sdpa's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = [sdpa_attention_forward(module, query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], None,
                                   **kwargs)[0] for a, e in segments]
    return torch.cat(outs, dim=1), None


def register() -> None:
    """Idempotent: make "easerve_packed" a valid attention implementation (sdpa's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, packed_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def attention_kwargs(lm_config, embeds: torch.Tensor, starts: list[int]) -> dict:
    """The forward kwargs that keep the packed prompts apart under the LM's current
    attention implementation: the segments for `ATTN_IMPL`, else a block-diagonal mask."""
    if lm_config._attn_implementation == ATTN_IMPL:
        return {SEGMENTS_KWARG: list(zip(starts, starts[1:]))}
    return {"attention_mask": block_causal_mask(lm_config, embeds, segment_ids(starts, embeds.device))}


def packed_ids(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """All prompts end to end, [1, S], and each prompt's start offset (plus S at the end)."""
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    flat = [t for p in prompts for t in p]
    return torch.tensor([flat], dtype=torch.long, device=device), starts


def segment_ids(starts: list[int], device: torch.device) -> torch.Tensor:
    """[1, S] index of the prompt each packed slot belongs to."""
    lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)[None]


def block_causal_mask(lm_config, embeds: torch.Tensor, segments: torch.Tensor):
    """Causal AND same-segment mask for the packed row, in the format the LM's attention
    implementation takes (4-D). Raises ValueError for implementations that take no mask."""
    from transformers.masking_utils import create_causal_mask

    same = lambda b, h, q, k: segments[b, q] == segments[b, k]  # noqa: E731
    mask = create_causal_mask(config=lm_config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              and_mask_function=same)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"batched prefill needs a mask-based attention implementation (sdpa, eager); "
                         f"this LM uses {lm_config._attn_implementation!r}: load the adapter with "
                         "attn_implementation='sdpa' or prefill one request per call")
    return mask


def split_results(request_ids: list[str], layers: list[tuple[torch.Tensor, torch.Tensor]],
                  logits: torch.Tensor, starts: list[int], deltas: list[int]) -> list[PrefillResult]:
    """Packed per-layer (keys, values) [1, kv_heads, S, d] -> one PrefillResult per prompt,
    its KV its own slice (own contiguous memory, so one result can be freed alone)."""
    out = []
    for b, (rid, delta) in enumerate(zip(request_ids, deltas)):
        a, e = starts[b], starts[b + 1]
        keys = [k[0, :, a:e].contiguous() for k, _ in layers]
        values = [v[0, :, a:e].contiguous() for _, v in layers]
        out.append(PrefillResult(rid, keys, values, logits[b].float(), e - a, int(delta)))
    return out
