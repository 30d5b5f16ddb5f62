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

Cached prefixes (the prefix cache's hits, `easerve.types.CachedPrefix`): their KV sits at the
front of the transformers cache (`fill_cache`, in request order) and the row holds only each
prompt's tokens after its prefix, at its own positions from there on; each prompt also
attends to its own prefix span (`PREFIX_KWARG` under `ATTN_IMPL`, the segment ids of the
cached positions in the mask otherwise), and `split_results` gives each request its prefix
KV and its computed KV as one.

`HFAdapter.prefill` uses these; each family only supplies its per-request positions
(`prefill_positions`: [1, T] for 1-D RoPE, [4, 1, T] for Qwen2.5-VL's M-RoPE).
"""
from __future__ import annotations

import torch

from easerve.types import PrefillResult

ATTN_IMPL = "easerve_packed"
SEGMENTS_KWARG = "easerve_segments"
PREFIX_KWARG = "easerve_prefix"


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa; with `SEGMENTS_KWARG` = [(start, end), ...] over a packed row, causal sdpa per
    segment (query [1, heads, S, d], key/value [1, kv_heads, past + S, d]; output [1, S,
    heads, d] like sdpa's). With `PREFIX_KWARG` = (past, [(start, end), ...]) the first
    `past` keys are cached prefixes: each segment also attends to its own span of them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS_KWARG, None)
    prefix = kwargs.pop(PREFIX_KWARG, None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    past, spans = prefix if prefix is not None else (0, [(0, 0)] * len(segments))
    outs = []
    for (a, e), (pa, pe) in zip(segments, spans):
        k, v = key[:, :, past + a:past + e], value[:, :, past + a:past + e]
        mask = None
        if pe > pa:  # the segment's queries see its whole prefix, then causally its own tokens
            k = torch.cat([key[:, :, pa:pe], k], dim=2)
            v = torch.cat([value[:, :, pa:pe], v], dim=2)
            n, m = e - a, k.shape[2]
            mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(diagonal=m - n)[None, None]
        outs.append(sdpa_attention_forward(module, query[:, :, a:e], k, v, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def register() -> None:
    """Idempotent: make "easerve_packed" a valid attention implementation (sdpa's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, packed_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def starts_of(lengths: list[int]) -> list[int]:
    """Each packed prompt's start offset, plus the row's length at the end."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


def fill_cache(cache, prefixes: list) -> int:
    """Put the cached prefixes' KV (easerve.types.CachedPrefix, in request order) at the
    front of an empty transformers cache; returns how many positions they take."""
    if not prefixes:
        return 0
    for i in range(len(prefixes[0].keys)):
        cache.update(torch.cat([p.keys[i] for p in prefixes], dim=1)[None],
                     torch.cat([p.values[i] for p in prefixes], dim=1)[None], i)
    return sum(p.num_tokens for p in prefixes)


def attention_kwargs(lm_config, embeds: torch.Tensor, starts: list[int], done: list[int] | None = None,
                     cache=None) -> dict:
    """The forward kwargs that keep the packed prompts apart under the LM's current
    attention implementation: the segments for `ATTN_IMPL`, else a block-diagonal mask.
    `done`: per prompt, the cached prefix tokens at the front of `cache` (none: all 0)."""
    done = done or [0] * (len(starts) - 1)
    past = sum(done)
    if lm_config._attn_implementation == ATTN_IMPL:
        kw = {SEGMENTS_KWARG: list(zip(starts, starts[1:]))}
        if past:
            pstarts = starts_of(done)
            kw[PREFIX_KWARG] = (past, list(zip(pstarts, pstarts[1:])))
        return kw
    segments = torch.cat([segment_ids(starts_of(done), embeds.device), segment_ids(starts, embeds.device)], dim=1)
    return {"attention_mask": block_causal_mask(lm_config, embeds, segments, cache if past else None)}


def segment_ids(starts: list[int], device: torch.device) -> torch.Tensor:
    """[1, S] index of the prompt each packed slot belongs to."""
    lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)[None]


def block_causal_mask(lm_config, embeds: torch.Tensor, segments: torch.Tensor, cache=None):
    """Causal AND same-segment mask for the packed row, in the format the LM's attention
    implementation takes (4-D). `segments` covers every key position (a filled `cache`'s,
    then the row's); query positions are absolute. Raises ValueError for implementations
    that take no mask."""
    from transformers.masking_utils import create_causal_mask

    same = lambda b, h, q, k: segments[b, q] == segments[b, k]  # noqa: E731
    mask = create_causal_mask(config=lm_config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                              and_mask_function=same)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"batched prefill needs a mask-based attention implementation (sdpa, eager); "
                         f"this LM uses {lm_config._attn_implementation!r}: load the adapter with "
                         "attn_implementation='sdpa' or prefill one request per call")
    return mask


def split_results(request_ids: list[str], layers: list[tuple[torch.Tensor, torch.Tensor]],
                  logits: torch.Tensor, starts: list[int], deltas: list[int], done: list[int] | None = None,
                  past: int = 0) -> list[PrefillResult]:
    """Per-layer (keys, values) [1, kv_heads, past + S, d] (cached prefixes, then the packed
    row) -> one PrefillResult per prompt, its KV (prefix + computed) in its own contiguous
    memory, so one result can be freed alone."""
    done = done or [0] * len(request_ids)
    pstarts = starts_of(done)
    out = []
    for b, (rid, delta) in enumerate(zip(request_ids, deltas)):
        a, e = past + starts[b], past + starts[b + 1]
        pa, pe = pstarts[b], pstarts[b + 1]
        if pe > pa:
            keys = [torch.cat([k[0, :, pa:pe], k[0, :, a:e]], dim=1) for k, _ in layers]
            values = [torch.cat([v[0, :, pa:pe], v[0, :, a:e]], dim=1) for _, v in layers]
        else:
            keys = [k[0, :, a:e].contiguous() for k, _ in layers]
            values = [v[0, :, a:e].contiguous() for _, v in layers]
        out.append(PrefillResult(rid, keys, values, logits[b].float(), e - a + pe - pa, int(delta), pe - pa))
    return out
