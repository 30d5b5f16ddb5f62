"""Ultravox adapter over `easerve.models.ultravox_hf` (upstream checkpoint layout, no
remote code): Whisper encoder + stacking projector for encode, the Llama LM for prefill.

One item is one clip; a clip longer than the encoder context carries several chunks
(`audio_values` [chunks, mels, T], `audio_lens` [chunks]) whose tokens follow each other.
Each chunk yields ceil(mel frames / (2 * stack_factor)) rows (upstream's rule).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from easerve.models.common import HFAdapter
from easerve.models.qwen2_audio import AudioPreprocess, check_items
from easerve.models.ultravox_hf import AUDIO_PLACEHOLDER, UltravoxModel, audio_token_lengths
from easerve.types import MMItem


class UltravoxAdapter(AudioPreprocess, HFAdapter):
    family = "ultravox"
    modalities = ("audio",)
    architectures = ("UltravoxModel",)
    model_class = UltravoxModel
    encoder_parts = ("audio_tower", "multi_modal_projector")
    lm_parts = ("language_model",)
    lm_path = "language_model.model"
    lm_head_path = "language_model.lm_head"
    placeholder_tokens = {"audio": AUDIO_PLACEHOLDER}

    # ---- gateway ------------------------------------------------------------------------
    def split_items(self, out: Any, modality: str) -> list[tuple[dict, dict]]:
        counts = out["audio_num_chunks"].tolist()
        ends = torch.tensor(counts).cumsum(0).tolist()
        items = []
        for c, e in zip(counts, ends):
            lens = out["audio_lens"][e - c:e]
            values = out["audio_values"][e - c:e, :, : int(lens.max())]
            items.append(({"audio_values": values, "audio_lens": lens},
                          {"audio_token_len": out["audio_token_len"][e - c:e]}))
        return items

    def expected_tokens(self, modality: str, meta: dict[str, torch.Tensor]) -> int | None:
        n = meta.get("audio_token_len")
        return None if n is None else int(n.sum())

    # ---- LM hooks -----------------------------------------------------------------------
    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # upstream checkpoints put the audio token one past the LM vocab; its rows are replaced
        ids = ids.to(self.device)
        ids = ids.masked_fill(ids == self.placeholder_ids["audio"], 0)
        return self.language_model.get_input_embeddings()(ids)

    # ---- encode -------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        check_items(items, self.family)
        model = self._need_model()
        values, lens, token_len = self._stack_chunks(items)
        if int(lens.min()) <= 0:
            raise ValueError("an audio item has a chunk with no mel frames; send a non-empty clip")
        rows = model.get_audio_features(values, lens, token_len)
        out, start = [], 0
        for item in items:
            n = item.pixels["audio_lens"].shape[0]
            out.append(torch.cat(rows[start:start + n]))
            start += n
        return out

    def _stack_chunks(self, items: list[MMItem]):
        """All items' chunks as one zero-padded batch (padding is masked by the encoder)."""
        chunks = [i.pixels["audio_values"] for i in items]
        width = max(c.shape[-1] for c in chunks)
        values = torch.cat([F.pad(c, (0, width - c.shape[-1])) for c in chunks])
        lens = torch.cat([i.pixels["audio_lens"] for i in items]).to(self.device)
        token_len = audio_token_lengths(lens, self.config.stack_factor)
        return values.to(self.device, self.dtype), lens, token_len
