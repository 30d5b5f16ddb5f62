"""How the engine's KV pool plugs into an unmodified transformers decoder.

A decode step builds one *step cache* and passes it to the model twice: as the `cache`
(every attention layer calls `cache.update(k, v, layer_idx, ...)` with the step's new K/V
[B, kv_heads, 1, head_dim], which the step cache writes into the pool) and as the forward
kwarg `STEP_KWARG`, which reaches `easerve_attention` (registered as attn implementation
"easerve"), which hands the layer's attention to `step.attend`. Without that kwarg
"easerve" *is* sdpa, so the same model instance still prefills normally. Mask creation:
"easerve" is registered in `AttentionMaskInterface` as `sdpa_mask`, so prefill gets exactly
sdpa's masks, and a decode step (q_len 1, no padding mask, a cache that is not compileable)
skips mask building entirely (sdpa_mask returns None).

Step caches, one per backend (`select_attention`):
- "slots" (`SlotStepCache`): the batch's K/V are strided views of a `SlotKVPool`; sdpa
  reads them in place, with a length mask only when the rows' lengths differ.
- "paged-gather" (`PagedStepCache`): a `PagedKVPool` on a device without flashinfer; the
  batch's blocks are gathered (copied) per layer, then sdpa with a length mask.
- "flashinfer" (`FlashInferStepCache`): a `PagedKVPool` on CUDA with the `flashinfer`
  package and a head_dim it has kernels for (64/128/256); its paged decode kernel reads the
  pool's pages in place (tensor cores for GQA groups other than 1/2/3/4/6/8).

Only plain causal full attention is supported (no sliding-window layers), and one query
token per request per step.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from easerve.engine.kv_pool import PagedKVPool, SlotKVPool

ATTN_IMPL = "easerve"
STEP_KWARG = "easerve_step"
BACKENDS = ("slots", "paged-gather", "flashinfer")


def easerve_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, except during an engine decode step, whose step cache computes the attention."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return step.attend(module, query, key, value, **kwargs)


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


# ---- backend selection ----------------------------------------------------------------------
def import_flashinfer() -> Any | None:
    """The flashinfer module, or None when the package is not installed."""
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


FLASHINFER_HEAD_DIMS = (64, 128, 256)
# GQA group sizes (query heads per kv head) flashinfer's decode kernel without tensor cores is
# built for; any other group runs its tensor-core (prefill-kernel) path
FLASHINFER_CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8)


def paged_kernel_available(device_type: str, dtype: torch.dtype, flashinfer_importable: bool,
                           head_dim: int | None = None) -> bool:
    """Whether flashinfer's paged decode kernel can serve this device, KV dtype and head_dim
    (64, 128 or 256; None: not checked)."""
    return (flashinfer_importable and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and (head_dim is None or head_dim in FLASHINFER_HEAD_DIMS))


def flashinfer_tensor_cores(num_heads: int, kv_heads: int) -> bool:
    """`use_tensor_cores` for BatchDecodeWithPagedKVCacheWrapper: needed when the GQA group
    (num_heads / kv_heads; Qwen2.5-VL-7B: 28 / 4 = 7) is not one the plain decode kernel has."""
    if kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    return num_heads // kv_heads not in FLASHINFER_CUDA_CORE_GROUPS


def flashinfer_decode_wrapper(flashinfer: Any, num_heads: int, kv_heads: int, device: torch.device,
                              workspace_bytes: int) -> Any:
    """flashinfer's paged decode wrapper ("NHD") on a zeroed workspace (its scheduler reads
    state there that must start at zero), with tensor cores when the GQA group needs them."""
    workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=flashinfer_tensor_cores(num_heads, kv_heads))


def select_attention(layout: str, paged_kernel: bool) -> str:
    """The attention backend for a KV layout ("paged" / "slots"), given
    `paged_kernel_available(...)`."""
    if layout == "slots":
        return "slots"
    if layout != "paged":
        raise ValueError(f"KV layout must be 'paged' or 'slots', got {layout!r}")
    return "flashinfer" if paged_kernel else "paged-gather"


def length_mask(positions: list[int] | tuple[int, ...], pos: torch.Tensor, kv_len: int) -> torch.Tensor | None:
    """[B, 1, 1, kv_len] bool (row b sees its first positions[b] + 1 tokens), or None when
    every row has the same length (then sdpa needs no mask)."""
    if min(positions) == max(positions):
        return None
    return (torch.arange(kv_len, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]


_SDPA_ONLY = frozenset(("softcap", "position_bias", "s_aux", "sliding_window"))


def decode_sdpa(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
    """What `sdpa_attention_forward` computes for one query token per row, in fewer ops:
    query [B, heads, 1, d] is grouped onto the kv heads of key/value [B, kv_heads, L, d]
    (no repeat of K/V) and the output comes back as [B, 1, heads, d]. Anything beyond plain
    scaled attention (softcap, position bias, sinks, a window) goes to sdpa_attention_forward."""
    if query.shape[2] != 1 or dropout or (not _SDPA_ONLY.isdisjoint(kwargs)
                                          and any(kwargs.get(k) is not None for k in _SDPA_ONLY)):
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    b, heads, _, d = query.shape
    q = query.reshape(b, key.shape[1], heads // key.shape[1], d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, 1, heads, value.shape[-1]), None


# ---- step caches ------------------------------------------------------------------------------
class _StepCache:
    """Duck-typed to what transformers' decoders and mask creation read from a cache
    (update, get_seq_length, get_mask_sizes, get_query_offset, is_sliding, len)."""

    is_compileable = False

    def __init__(self, num_layers: int, kv_len: int, mask: torch.Tensor | None) -> None:
        self.kv_len, self.mask = kv_len, mask
        self.is_sliding = [False] * num_layers

    def forward_kwargs(self) -> dict[str, Any]:
        return {STEP_KWARG: self}

    def attend(self, module, query, key, value, **kwargs):
        return decode_sdpa(module, query, key, value, self.mask, **kwargs)

    @staticmethod
    def _one_token(key_states: torch.Tensor) -> None:
        if key_states.shape[2] != 1:
            raise ValueError(f"the engine's cache decodes one token per request, got {key_states.shape[2]}")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len - 1  # past length of the longest row

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.kv_len - 1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_len, 0

    def __len__(self) -> int:
        return len(self.is_sliding)


class SlotStepCache(_StepCache):
    """Row b is slot b; it writes its token where `index` says and attends to the slots'
    views in place."""

    def __init__(self, pool: SlotKVPool, index: torch.Tensor, kv_len: int, mask: torch.Tensor | None) -> None:
        super().__init__(pool.layout.num_layers, kv_len, mask)
        self.pool, self.index = pool, index  # index: pool.step_index(B, positions)
        self.rows = index.shape[0] // (2 * pool.layout.kv_heads)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._one_token(key_states)
        self.pool.write_step(layer_idx, self.index, key_states, value_states)
        return self.pool.view(layer_idx, self.rows, self.kv_len)


class PagedStepCache(_StepCache):
    """Row b writes at (blk[b], off[b]) and attends to a gathered copy of its blocks."""

    def __init__(self, pool: PagedKVPool, blk: torch.Tensor, off: torch.Tensor, table: torch.Tensor,
                 kv_len: int, mask: torch.Tensor | None) -> None:
        super().__init__(pool.layout.num_layers, kv_len, mask)
        self.pool, self.blk, self.off, self.table = pool, blk, off, table

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._one_token(key_states)
        self.pool.write_step(layer_idx, self.blk, self.off, key_states[:, :, 0], value_states[:, :, 0])
        return self.pool.gather(layer_idx, self.table, self.kv_len)


class FlashInferStepCache(_StepCache):
    """Row b writes at (blk[b], off[b]); flashinfer's paged decode kernel reads the pages of
    `table` in place. `wrapper` is a flashinfer BatchDecodeWithPagedKVCacheWrapper ("NHD"),
    planned once per step on the first layer's call."""

    def __init__(self, pool: PagedKVPool, wrapper: Any, blk: torch.Tensor, off: torch.Tensor,
                 tables: tuple[tuple[int, ...], ...], positions: tuple[int, ...]) -> None:
        super().__init__(pool.layout.num_layers, max(positions) + 1, None)
        self.pool, self.wrapper, self.blk, self.off = pool, wrapper, blk, off
        self.indptr, self.indices, self.last_len = paged_kv_indices(tables, positions, pool.block_size)
        self._planned, self._layer = False, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._one_token(key_states)
        self.pool.write_step(layer_idx, self.blk, self.off, key_states[:, :, 0], value_states[:, :, 0])
        self._layer = layer_idx
        return key_states, value_states  # attend() reads the pool, not these

    def attend(self, module, query, key, value, scaling: float | None = None, **kwargs):
        lay = self.pool.layout
        if not self._planned:  # host index tensors: plan copies them up itself, without a sync each
            self.wrapper.plan(torch.tensor(self.indptr, dtype=torch.int32),
                              torch.tensor(self.indices, dtype=torch.int32),
                              torch.tensor(self.last_len, dtype=torch.int32),
                              query.shape[1], lay.kv_heads, lay.head_dim, self.pool.block_size,
                              pos_encoding_mode="NONE", q_data_type=query.dtype, kv_data_type=lay.dtype,
                              sm_scale=scaling)
            self._planned = True
        layer = getattr(module, "layer_idx", self._layer)
        out = self.wrapper.run(query[:, :, 0].contiguous(), self.pool.layer_kv(layer))  # [B, heads, d]
        return out[:, None], None  # [B, q_len 1, heads, d], as sdpa_attention_forward returns


def paged_kv_indices(tables, positions, block_size: int) -> tuple[list[int], list[int], list[int]]:
    """flashinfer's CSR page table for rows attending to positions[b] + 1 tokens:
    (indptr [B+1], page indices, last page lengths in 1..block_size)."""
    indptr, indices, last = [0], [], []
    for table, p in zip(tables, positions):
        n = p // block_size + 1
        indices.extend(table[:n])
        indptr.append(len(indices))
        last.append(p + 1 - (n - 1) * block_size)
    return indptr, indices, last
