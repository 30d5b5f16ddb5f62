"""Tensor plumbing of batched prefill: several prompts of different lengths in one LM forward.

Layout: right padding. Prompt b (length T_b) fills row b of a [B, L] batch, L = max T_b;
the pad slots hold token id 0 and positions that keep counting past the prompt. The
forward gets a [B, L] padding mask, from which transformers builds the causal + padding
4-D mask. A real query only ever sees its own row's keys at positions <= its own, so
real rows compute exactly what a one-prompt forward computes; pad rows are thrown away
(their KV is cut off, their logits never read).

`HFAdapter.prefill` uses these; each family only supplies its per-request positions
(`prefill_positions`: [1, T] for 1-D RoPE, [4, 1, T] for Qwen2.5-VL's M-RoPE).
"""
from __future__ import annotations

import torch

from easerve.types import PrefillResult

PAD_ID = 0  # any id inside the vocab: pad slots are masked and dropped


def padded_ids(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and the lengths [B] (long, on `device`)."""
    lens = [len(p) for p in prompts]
    width = max(lens)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), torch.tensor(lens, dtype=torch.long, device=device)


def pad_positions(pos: torch.Tensor, width: int) -> torch.Tensor:
    """One prompt's positions (..., 1, T) -> (..., 1, width): pad slots continue from the
    last position by +1 per slot (finite RoPE angles; their rows are dropped anyway)."""
    extra = width - pos.shape[-1]
    if extra == 0:
        return pos
    step = torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
    return torch.cat([pos, pos[..., -1:] + step], dim=-1)


def padding_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] long mask: 1 on each row's first lens[b] slots (transformers' 2-D format)."""
    return (torch.arange(width, device=lens.device)[None, :] < lens[:, None]).long()


def last_rows(hidden: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """hidden [B, L, H] -> [B, H]: each row's last real position."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lens - 1]


def split_results(request_ids: list[str], layers: list[tuple[torch.Tensor, torch.Tensor]],
                  logits: torch.Tensor, lens: list[int], deltas: list[int]) -> list[PrefillResult]:
    """Batched per-layer (keys, values) [B, kv_heads, L, d] -> one PrefillResult per row,
    its KV cut to its own length (own contiguous memory, so one result can be freed alone)."""
    out = []
    for b, (rid, n, delta) in enumerate(zip(request_ids, lens, deltas)):
        keys = [k[b, :, :n].contiguous() for k, _ in layers]
        values = [v[b, :, :n].contiguous() for _, v in layers]
        out.append(PrefillResult(rid, keys, values, logits[b].float(), n, int(delta)))
    return out
