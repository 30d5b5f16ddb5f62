"""The decode engine's preallocated physical KV memory.

One tensor [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; block b of layer l
holds the keys (index 0) / values (index 1) of block_size consecutive token positions of
whichever request the `BlockManager` gave it to. The pool never decides ownership: it
writes and gathers through block tables, and reports capacity from its BlockManager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from easerve.engine.block_manager import BlockManager


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_text_config(cls, cfg, dtype: torch.dtype, device) -> "KVLayout":
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, dtype, torch.device(device))


class KVPool:
    def __init__(self, layout: KVLayout, blocks: BlockManager) -> None:
        self.layout = layout
        self.blocks = blocks
        self.block_size = blocks.block_size
        shape = (layout.num_layers, 2, blocks.num_blocks, blocks.block_size, layout.kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=layout.device)

    # ---- reporting --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def free_tokens(self) -> int:
        return self.blocks.free_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.capacity_tokens

    # ---- writes -------------------------------------------------------------------------------
    def check_prompt_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor], prompt_len: int) -> None:
        """Raise ValueError unless keys/values are per-layer [kv_heads, prompt_len, head_dim]."""
        lay = self.layout
        want = (lay.kv_heads, prompt_len, lay.head_dim)
        if len(keys) != lay.num_layers or len(values) != lay.num_layers:
            raise ValueError(f"KV has {len(keys)}/{len(values)} layers, this model has {lay.num_layers}; "
                             "the payload must come from a prefill of the same model")
        for i, (k, v) in enumerate(zip(keys, values)):
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise ValueError(f"layer {i} KV shapes {tuple(k.shape)}/{tuple(v.shape)}, expected {want} "
                                 "([kv_heads, prompt_len, head_dim])")

    def write_prompt(self, table: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy a prompt's KV (per layer [kv_heads, T, head_dim]) into positions 0..T-1."""
        n = keys[0].shape[1]
        pos = torch.arange(n, device=self.kv.device)
        blk = torch.tensor(table, device=self.kv.device)[pos // self.block_size]
        off = pos % self.block_size
        k_all = torch.stack([k.transpose(0, 1) for k in keys]).to(self.kv.device, self.kv.dtype)
        v_all = torch.stack([v.transpose(0, 1) for v in values]).to(self.kv.device, self.kv.dtype)
        self.kv[:, 0, blk, off] = k_all   # [L, T, H, d]
        self.kv[:, 1, blk, off] = v_all

    def write_step(self, layer: int, blk: torch.Tensor, off: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one token per row: key/value [B, kv_heads, head_dim] at (blk[b], off[b])."""
        self.kv[layer, 0, blk, off] = key.to(self.kv.dtype)
        self.kv[layer, 1, blk, off] = value.to(self.kv.dtype)

    # ---- reads ---------------------------------------------------------------------------------
    def gather(self, layer: int, table: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, kv_heads, kv_len, head_dim] of each row's first kv_len positions
        (table [B, >= ceil(kv_len / block_size)]); rows shorter than kv_len hold stale data
        past their length, which the attention mask hides."""
        kv = self.kv[layer]
        if table.shape[1] == 1:  # slot layout: cut the slot to kv_len before copying it
            k = kv[0, :, :kv_len].index_select(0, table[:, 0])
            v = kv[1, :, :kv_len].index_select(0, table[:, 0])
        else:  # index_select copies whole blocks (much faster than advanced indexing on CPU)
            b, nb = table.shape
            flat = table.reshape(-1)
            k = kv[0].index_select(0, flat).view(b, nb * self.block_size, *kv.shape[-2:])[:, :kv_len]
            v = kv[1].index_select(0, flat).view(b, nb * self.block_size, *kv.shape[-2:])[:, :kv_len]
        return k.transpose(1, 2), v.transpose(1, 2)
