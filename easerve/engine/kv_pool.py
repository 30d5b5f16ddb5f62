"""The decode engine's preallocated physical KV memory, in one of two layouts.

- `PagedKVPool`: one tensor [num_layers, 2, num_blocks, block_size, kv_heads, head_dim];
  block b of layer l holds the keys (index 0) / values (index 1) of block_size consecutive
  positions of whichever request the `BlockManager` gave it to. A layer's K (or V) is in
  flashinfer's "NHD" paged layout; on CPU a step gathers the batch's blocks (a copy).
- `SlotKVPool`: one tensor [num_layers, 2, num_slots, kv_heads, max_seq_len, head_dim];
  slot s holds one request's positions 0..max_seq_len-1. With the running requests in
  slots 0..n-1 (see `BlockManager.compact`), a layer's batch K/V [n, kv_heads, L, head_dim]
  is a strided view of the pool that attention reads directly: no per-step copy.

A pool never decides ownership: it writes and reads where its BlockManager's tables say,
and reports capacity from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from easerve.errors import InvalidRequest
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

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token position: layers x (K and V) x kv_heads x head_dim x dtype size."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class _Pool:
    kv: torch.Tensor

    def __init__(self, layout: KVLayout, blocks: BlockManager) -> None:
        self.layout = layout
        self.blocks = blocks
        self.block_size = blocks.block_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def free_tokens(self) -> int:
        return self.blocks.free_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.capacity_tokens

    def check_prompt_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor], prompt_len: int) -> None:
        """Raise ValueError unless keys/values are per-layer [kv_heads, prompt_len, head_dim]."""
        lay = self.layout
        want = (lay.kv_heads, prompt_len, lay.head_dim)
        if len(keys) != lay.num_layers or len(values) != lay.num_layers:
            raise InvalidRequest(f"KV has {len(keys)}/{len(values)} layers, this model has {lay.num_layers}; "
                             "the payload must come from a prefill of the same model")
        for i, (k, v) in enumerate(zip(keys, values)):
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise InvalidRequest(f"layer {i} KV shapes {tuple(k.shape)}/{tuple(v.shape)}, expected {want} "
                                 "([kv_heads, prompt_len, head_dim])")


class PagedKVPool(_Pool):
    def __init__(self, layout: KVLayout, blocks: BlockManager) -> None:
        super().__init__(layout, blocks)
        shape = (layout.num_layers, 2, blocks.num_blocks, blocks.block_size, layout.kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=layout.device)

    def write_prompt(self, table: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor],
                     start: int = 0) -> None:
        """Copy a prompt's KV (per layer [kv_heads, T, head_dim]) into positions start..T-1
        (positions before `start` sit in blocks another choice of the request wrote)."""
        n = keys[0].shape[1]
        pos = torch.arange(start, n, device=self.kv.device)
        blk = torch.tensor(table, device=self.kv.device)[pos // self.block_size]
        off = pos % self.block_size
        k_all = torch.stack([k[:, start:].transpose(0, 1) for k in keys]).to(self.kv.device, self.kv.dtype)
        v_all = torch.stack([v[:, start:].transpose(0, 1) for v in values]).to(self.kv.device, self.kv.dtype)
        self.kv[:, 0, blk, off] = k_all   # [L, T, H, d]
        self.kv[:, 1, blk, off] = v_all

    def write_step(self, layer: int, blk: torch.Tensor, off: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one token per row: key/value [B, kv_heads, head_dim] at (blk[b], off[b])."""
        self.kv[layer, 0, blk, off] = key.to(self.kv.dtype)
        self.kv[layer, 1, blk, off] = value.to(self.kv.dtype)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pages, each [num_blocks, block_size, kv_heads, head_dim] ("NHD")."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def gather(self, layer: int, table: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, kv_heads, kv_len, head_dim] of each row's first kv_len positions
        (table [B, >= ceil(kv_len / block_size)]), copied; rows shorter than kv_len hold
        stale data past their length, which the attention mask hides."""
        kv = self.kv[layer]
        b, nb = table.shape
        flat = table.reshape(-1)  # index_select copies whole blocks (much faster than advanced indexing on CPU)
        k = kv[0].index_select(0, flat).view(b, nb * self.block_size, *kv.shape[-2:])[:, :kv_len]
        v = kv[1].index_select(0, flat).view(b, nb * self.block_size, *kv.shape[-2:])[:, :kv_len]
        return k.transpose(1, 2), v.transpose(1, 2)


class SlotKVPool(_Pool):
    def __init__(self, layout: KVLayout, blocks: BlockManager) -> None:
        super().__init__(layout, blocks)
        n, h, s, d = blocks.num_blocks, layout.kv_heads, blocks.block_size, layout.head_dim
        self.kv = torch.zeros((layout.num_layers, 2, n, h, s, d), dtype=layout.dtype, device=layout.device)
        self._flat = self.kv.view(layout.num_layers, 2 * n * h * s, d)  # a layer's (K|V, slot, head, pos) rows
        kv = self.kv
        self._stride = kv[0, 0].stride()  # [slots, heads, pos, d] of one layer's K (or V)
        self._offsets = [(kv[i, 0].storage_offset(), kv[i, 1].storage_offset()) for i in range(layout.num_layers)]
        dev = layout.device
        self._row_base = ((torch.arange(2, device=dev)[:, None, None] * n + torch.arange(n, device=dev)[None, :, None])
                          * h + torch.arange(h, device=dev)[None, None, :]) * s   # [2, slots, heads]

    def step_index(self, num_rows: int, pos: torch.Tensor) -> torch.Tensor:
        """Where a step writes: for K then V, slot b < num_rows, each head, position pos[b], the
        row of a layer's flat [2 * slots * heads * max_seq_len, head_dim] view (one per step)."""
        return (self._row_base[:, :num_rows] + pos[None, :, None]).reshape(-1)

    def write_prompt(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy a prompt's KV (per layer [kv_heads, T, head_dim]) into the slot's positions 0..T-1."""
        n = keys[0].shape[1]
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.kv[layer, 0, slot, :, :n].copy_(k)
            self.kv[layer, 1, slot, :, :n].copy_(v)

    def write_step(self, layer: int, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one token per row: key/value [B, kv_heads, (1,) head_dim] of slot b at the
        positions `index` (from step_index) names, K and V in one copy."""
        d = key.shape[-1]
        self._flat[layer].index_copy_(0, index, torch.cat((key.reshape(-1, d), value.reshape(-1, d))))

    def view(self, layer: int, num_rows: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_rows, kv_heads, kv_len, head_dim] of slots 0..num_rows-1: views, not copies."""
        size = (num_rows, self.layout.kv_heads, kv_len, self.layout.head_dim)
        if num_rows > self.blocks.num_blocks or kv_len > self.block_size:
            raise ValueError(f"view of {num_rows} slots x {kv_len} positions exceeds the pool")
        k_off, v_off = self._offsets[layer]
        return self.kv.as_strided(size, self._stride, k_off), self.kv.as_strided(size, self._stride, v_off)

    def move(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first num_tokens positions of slot src into slot dst (every layer)."""
        self.kv[:, :, dst, :, :num_tokens].copy_(self.kv[:, :, src, :, :num_tokens])
