"""Qwen2-Audio adapter: Whisper-style encoder (+ avg-pool) and a linear projector over a
Qwen2 LM (`Qwen2AudioForConditionalGeneration`).

Every clip is padded to the encoder's full context (30 s on the real model) by the
processor; encode masks each clip's padding frames like the HF model and trims the
output to `audio_tower._get_feat_extract_output_lengths(...)` rows per clip.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import Qwen2AudioForConditionalGeneration
from transformers.masking_utils import create_bidirectional_mask

from easerve.models.common import HFAdapter
from easerve.errors import InvalidRequest
from easerve.types import ChatMessage, MMItem, ProcessedPrompt, as_messages


def check_audio(clips: list[Any]) -> None:
    """Reject what no audio processor can turn into tokens: empty or non-mono clips."""
    for i, clip in enumerate(clips):
        arr = np.asarray(clip)
        if arr.ndim != 1:
            raise InvalidRequest(f"audio clip {i} has shape {arr.shape}; send mono samples as a 1-D array")
        if arr.size == 0:
            raise InvalidRequest(f"audio clip {i} is empty; send at least a few samples of audio")


def message_audio(messages: tuple[ChatMessage, ...]) -> list[Any]:
    """The audio arrays of chat messages, in prompt order."""
    return [p.value for m in messages for p in m.media if p.kind == "audio"]


def check_items(items: list[MMItem], family: str) -> None:
    bad = sorted({i.modality for i in items} - {"audio"})
    if bad:
        raise InvalidRequest(f"{family} encodes audio items only, got {bad}; route other media elsewhere")


class AudioPreprocess:
    """Mixin for `HFAdapter` subclasses: validate audio before the HF processor sees it."""

    def preprocess(self, messages, add_generation_prompt: bool = True) -> ProcessedPrompt:
        messages = as_messages(messages)
        check_audio(message_audio(messages))
        return super().preprocess(messages, add_generation_prompt)

    def preprocess_prompt(self, prompt: str, images=(), videos=(), audios=()) -> ProcessedPrompt:
        check_audio(list(audios))
        return super().preprocess_prompt(prompt, images, videos, audios)


def qwen2_audio_tokens(feature_len: torch.Tensor) -> torch.Tensor:
    """Mel frames -> audio tokens: conv stride 2, then avg-pool 2 (the HF processor's rule)."""
    after_conv = (feature_len - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class Qwen2AudioAdapter(AudioPreprocess, HFAdapter):
    family = "qwen2-audio"
    modalities = ("audio",)
    model_class = Qwen2AudioForConditionalGeneration
    encoder_parts = ("model.audio_tower", "model.multi_modal_projector")
    legacy_renames = ((r"^language_model\.lm_head\.", "lm_head."),
                      (r"^language_model\.model\.", "model.language_model."),
                      (r"^audio_tower\.", "model.audio_tower."),
                      (r"^multi_modal_projector\.", "model.multi_modal_projector."))
    placeholder_tokens = {"audio": "<|AUDIO|>"}

    # ---- gateway ------------------------------------------------------------------------
    def split_items(self, out: Any, modality: str) -> list[tuple[dict, dict]]:
        feats, mask = out["input_features"], out["feature_attention_mask"]
        return [({"input_features": feats[i:i + 1]}, {"feature_lengths": mask[i].sum().view(1)})
                for i in range(feats.shape[0])]

    def expected_tokens(self, modality: str, meta: dict[str, torch.Tensor]) -> int | None:
        if "feature_lengths" not in meta:
            return None
        return int(qwen2_audio_tokens(meta["feature_lengths"]).sum())

    # ---- encode -------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        check_items(items, self.family)
        model = self._need_model().model
        feats = self._stack_features(items)
        lengths = torch.cat([i.meta["feature_lengths"] for i in items]).to(self.device)
        conv_len, out_len = model.audio_tower._get_feat_extract_output_lengths(lengths)
        if int(out_len.min()) <= 0:
            raise InvalidRequest("an audio item has no feature frames; send a non-empty clip")
        mask = self._attention_mask(model, conv_len, feats)
        hidden = model.audio_tower(feats, attention_mask=mask).last_hidden_state
        embeds = model.multi_modal_projector(hidden)
        return [e[: int(n)] for e, n in zip(embeds, out_len)]

    def _stack_features(self, items: list[MMItem]) -> torch.Tensor:
        widths = {i.pixels["input_features"].shape[-1] for i in items}
        if len(widths) != 1:
            raise InvalidRequest(f"audio items have mel widths {sorted(widths)}; Qwen2-Audio needs every "
                             "clip padded to the encoder context by this model's processor")
        return torch.cat([i.pixels["input_features"] for i in items]).to(self.device, self.dtype)

    @staticmethod
    def _attention_mask(model, conv_len: torch.Tensor, feats: torch.Tensor):
        """Key mask over the conv output frames, as `Qwen2AudioModel.forward` builds it."""
        t = (feats.shape[-1] - 2) // 2 + 1
        keep = (torch.arange(t, device=feats.device)[None, :] < conv_len[:, None]).long()
        dummy = torch.zeros(feats.shape[0], t, 1, dtype=feats.dtype, device=feats.device)
        return create_bidirectional_mask(config=model.audio_tower.config, inputs_embeds=dummy,
                                         attention_mask=keep)
