"""Domain types shared by every stage. Torch appears only as tensor annotations.

These are the typed objects that cross module boundaries (and, through
`easerve.wire.codec`, process boundaries). Keep them small and frozen where possible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from easerve.errors import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    import torch

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[str, ...] = ("image", "video", "audio")
Role = Literal["encode", "prefill", "decode", "full", "processor"]
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob and the top k

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in 0..{MAX_LOGPROBS} (top tokens per position), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class MMItem:
    """One media item after the HF processor, in prompt order.

    `pixels` holds the heavy processor outputs only the encoder needs (pixel_values,
    input_features, ...). `meta` holds the small tensors that prefill also needs
    (image_sizes, image_grid_thw, video_grid_thw, second_per_grid_ts, feature lengths).
    `num_tokens` is how many placeholder tokens this item fills in input_ids.
    `content_hash` (easerve.cache.media_hash; empty: not cacheable) keys the encoder cache.
    `replacement` (gateway only, never sent) is the text the HF processor put in place of
    the item's placeholder string; with `meta` and `num_tokens` it lets the gateway build a
    prompt for the same media again without the processor (`HFAdapter.prompt_from_items`).
    """

    modality: str
    pixels: dict[str, "torch.Tensor"]
    meta: dict[str, "torch.Tensor"]
    num_tokens: int
    content_hash: bytes = b""
    replacement: str = ""


@dataclass
class ProcessedPrompt:
    """What the gateway produces: token ids with placeholders, plus media items."""

    input_ids: list[int]
    items: list[MMItem] = field(default_factory=list)


@dataclass
class PrefillRequest:
    """What prefill consumes: token ids, one embedding tensor per media item
    ([num_tokens, hidden], prompt order), and each item's meta."""

    request_id: str
    input_ids: list[int]
    embeddings: list["torch.Tensor"]
    items_meta: list[tuple[str, dict[str, "torch.Tensor"]]]  # (modality, meta)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class PrefillResult:
    """KV of the prompt ([kv_heads, T, head_dim] per layer), the last position's logits,
    and the per-request position state (rope_delta is 0 except for M-RoPE models)."""

    request_id: str
    keys: list["torch.Tensor"]
    values: list["torch.Tensor"]
    last_logits: "torch.Tensor"
    prompt_len: int
    rope_delta: int = 0


@dataclass
class KVPayload:
    """Everything decode needs to continue a request: the prompt KV, the first token
    (already sampled by prefill), positions and sampling state. Crosses processes
    through `easerve.wire.codec` (raw tensors + typed header, never pickle)."""

    request_id: str
    keys: list["torch.Tensor"]
    values: list["torch.Tensor"]
    prompt_len: int
    rope_delta: int
    first_token: int
    sampling: SamplingParams
    prompt_ids_tail: list[int] = field(default_factory=list)  # for stop strings / detok context

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0
