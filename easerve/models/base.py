"""The one interface every model family implements.

An adapter wraps the real transformers classes of one family. It is built for a
*role*, and loads only the weights that role uses:

- "processor": no weights (gateway: chat template, tokenizer, HF processor)
- "encode":    modality tower + projector
- "prefill" / "decode": language model (embeddings, decoder, lm_head)
- "full":      everything (tests, co-located encode+prefill, the monolith baseline)

The engine (`easerve.engine`) drives decode through `lm_forward` and
`decode_position_ids`; it owns the KV memory and passes its own cache object.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from easerve.errors import InvalidRequest
from easerve.types import ChatMessage, MMItem, PrefillRequest, PrefillResult, ProcessedPrompt


class ModelAdapter(ABC):
    family: ClassVar[str]              # "llava-next" | "qwen2.5-vl" | "qwen2-audio" | "ultravox"
    modalities: ClassVar[tuple[str, ...]]  # media kinds this family accepts

    role: str
    device: torch.device
    dtype: torch.dtype
    config: Any                        # the full HF config
    text_config: Any                   # the LM's config (layers, kv heads, head_dim, vocab)

    # ---- gateway side (role "processor" or any) -------------------------------------
    @abstractmethod
    def preprocess(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> ProcessedPrompt:
        """Chat messages with decoded media -> token ids (with placeholders expanded) + media items.

        Media part values: an image a PIL.Image, a video list[PIL.Image] | np.ndarray[T,H,W,C],
        audio an np.ndarray float32 mono at `sampling_rate`. HF-style dicts are accepted too
        (`easerve.types.as_messages`). Raises ValueError with what to change on bad media /
        unsupported modality.
        """

    @property
    @abstractmethod
    def sampling_rate(self) -> int | None:
        """Audio sampling rate the processor expects (None for non-audio families)."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.generation_eos, "__iter__", None)
        return tuple(self.generation_eos) if eos else (int(self.generation_eos),)

    generation_eos: Any = ()

    # ---- encode (role "encode" / "full") --------------------------------------------
    @abstractmethod
    def encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        """Batch of media items -> one [num_tokens, hidden] embedding per item, same order."""

    # ---- prefill (role "prefill" / "decode" / "full") --------------------------------
    @abstractmethod
    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        """Scatter each request's embeddings at its placeholders, run the LM over the
        prompts (one forward for the whole batch), return per request its per-layer KV
        [kv_heads, T, head_dim], last logits and rope_delta, in request order."""

    def check_prefill(self, req: PrefillRequest) -> None:
        """Raise ValueError naming what to change when `req` cannot be prefilled, without
        running the model (batching callers fail one bad request alone this way)."""
        if not req.input_ids:
            raise InvalidRequest(f"request {req.request_id}: empty prompt; send at least one token")

    # ---- decode hooks used by the engine ---------------------------------------------
    @abstractmethod
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] or [B, L] token ids -> embeddings [..., hidden]."""

    @abstractmethod
    def lm_forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                   cache: Any, **attn_kwargs: Any) -> torch.Tensor:
        """Run the decoder with an external cache object; return logits [B, L, vocab].
        `attn_kwargs` reach the attention function unchanged."""

    @abstractmethod
    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """Absolute text positions [B] (prompt_len + k) and per-request rope deltas [B]
        -> position_ids in the layout the LM wants ([B, 1], or [3, B, 1] for M-RoPE)."""

    @property
    @abstractmethod
    def language_model(self) -> torch.nn.Module:
        """The decoder module whose attention implementation the engine switches."""

    def lm_head_slot(self) -> tuple[torch.nn.Module, str] | None:
        """(parent module, attribute) of the lm_head, for code that swaps the layer (the
        engine's CPU weight layouts); None when the adapter exposes none."""
        return None

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @abstractmethod
    def parameters(self) -> list[torch.nn.Parameter]:
        """Parameters actually held by this adapter instance (for partial-loading checks)."""
