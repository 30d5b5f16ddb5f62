"""How the engine's KV pool plugs into an unmodified transformers decoder.

- `PoolCache` is passed as the model's `cache`: every attention layer calls
  `cache.update(k, v, layer_idx, ...)` with the step's new K/V [B, kv_heads, 1, head_dim];
  it writes them into the pool at each request's position and returns the batch's K/V
  [B, kv_heads, L, head_dim] (L = the longest request; shorter rows carry stale data).
- `easerve_attention` (registered as attn implementation "easerve") is sdpa with the
  engine's per-request length mask, which reaches it as the forward kwarg `KV_MASK_KWARG`.
  Without that kwarg it *is* sdpa, so the same model instance still prefills normally.
- Mask creation: "easerve" is registered in `AttentionMaskInterface` as `sdpa_mask`, so
  prefill gets exactly sdpa's masks, and a decode step (q_len 1, no padding mask, a cache
  that is not compileable) skips mask building entirely (sdpa_mask returns None).

Only plain causal full attention is supported (no sliding-window layers), and one query
token per request per step.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from easerve.engine.kv_pool import KVPool

ATTN_IMPL = "easerve"
KV_MASK_KWARG = "easerve_kv_mask"


def easerve_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, except that the engine's [B, 1, 1, L] boolean length mask replaces the
    (absent) causal mask during a decode step."""
    engine_mask = kwargs.pop(KV_MASK_KWARG, None)
    if engine_mask is not None:
        attention_mask = engine_mask
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Idempotent: make "easerve" a valid attention implementation."""
    AttentionInterface.register(ATTN_IMPL, easerve_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def use_engine_attention(language_model: torch.nn.Module) -> None:
    """Switch a decoder (a transformers PreTrainedModel) to the "easerve" implementation."""
    register()
    cfg = getattr(language_model, "config", None)
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        raise ValueError("the decode engine supports full-attention decoders only; this model has "
                         f"layer types {sorted(set(cfg.layer_types))}")
    if not hasattr(language_model, "set_attn_implementation"):
        raise ValueError(f"{type(language_model).__name__} is not a transformers PreTrainedModel; "
                         "adapter.language_model must return the decoder model itself")
    language_model.set_attn_implementation(ATTN_IMPL)


def step_attention_kwargs(kv_lens: torch.Tensor, kv_len: int) -> dict[str, torch.Tensor]:
    """The forward kwargs of one decode step: row b attends to its first kv_lens[b] positions."""
    mask = torch.arange(kv_len, device=kv_lens.device)[None, :] < kv_lens[:, None]
    return {KV_MASK_KWARG: mask[:, None, None, :]}


class PoolCache:
    """The cache object of one decode step (duck-typed to what transformers' decoders and
    mask creation read: update, get_seq_length, get_mask_sizes, get_query_offset)."""

    is_compileable = False

    def __init__(self, pool: KVPool, blk: torch.Tensor, off: torch.Tensor,
                 table: torch.Tensor, kv_len: int) -> None:
        self.pool, self.blk, self.off, self.table, self.kv_len = pool, blk, off, table, kv_len
        self.is_sliding = [False] * pool.layout.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[2] != 1:
            raise ValueError(f"PoolCache decodes one token per request, got {key_states.shape[2]}")
        self.pool.write_step(layer_idx, self.blk, self.off, key_states[:, :, 0], value_states[:, :, 0])
        return self.pool.gather(layer_idx, self.table, self.kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len - 1  # past length of the longest row

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.kv_len - 1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_len, 0

    def __len__(self) -> int:
        return self.pool.layout.num_layers
