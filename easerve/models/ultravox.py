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
from easerve.models.ultravox_hf import (AUDIO_PLACEHOLDER, UltravoxModel, audio_token_lengths, referenced_folder,
                                       upstream_to_native)
from easerve.models.weights import read_tensors, under
from easerve.errors import InvalidRequest
from easerve.types import MMItem, ProcessedPrompt


class UltravoxAdapter(AudioPreprocess, HFAdapter):
    family = "ultravox"
    modalities = ("audio",)
    model_class = UltravoxModel
    encoder_parts = ("audio_tower", "multi_modal_projector")
    lm_parts = ("language_model",)
    lm_path = "language_model.model"
    lm_head_path = "language_model.lm_head"
    placeholder_tokens = {"audio": AUDIO_PLACEHOLDER}
    assemble_full = True  # the published layout keeps the LM (and maybe the encoder) in other folders
    # referenced folder's name prefixes -> ours (other names, e.g. Whisper's decoder, are no role's)
    REFERENCED = {"text": (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
                  "audio": (("model.encoder.", "audio_tower."),)}
    REFERENCED_PART = {"text": "language_model", "audio": "audio_tower"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # upstream v0.5 configs carry no (or a stale default) audio_token_index; prompts use the processor's
        self.config.audio_token_index = self.placeholder_ids["audio"]

    # ---- loading ------------------------------------------------------------------------
    def read_part_tensors(self, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """This folder's tensors, then what is still missing from the folders the config names
        by `text_model_id` / `audio_model_id` (upstream v0.5 keeps the LM weights there)."""
        wanted = under(parts)
        tensors = read_tensors(self.path, wanted, dtype=self.dtype, device=self.device)
        for kind, rules in self.REFERENCED.items():
            model_id = getattr(self.config, f"{kind}_model_id", None)
            if model_id is None or self.REFERENCED_PART[kind] not in parts:
                continue
            folder = referenced_folder(model_id, kind, weights=True)
            tensors.update(read_tensors(folder, _referenced_map(rules, wanted, set(tensors)),
                                        dtype=self.dtype, device=self.device))
        return tensors

    # ---- gateway ------------------------------------------------------------------------
    def _to_prompt(self, out: Any) -> ProcessedPrompt:
        """Our processor's outputs, or upstream UltravoxProcessor's (`audio_token_start_idx`)."""
        if "audio_token_start_idx" not in out:
            return super()._to_prompt(out)
        native = upstream_to_native(out, self.placeholder_ids["audio"])
        items = [MMItem("audio", pixels, meta, int(meta["audio_token_len"].sum()))
                 for pixels, meta in self.split_items(native, "audio")]
        return ProcessedPrompt(input_ids=native["input_ids"][0].tolist(), items=items)

    def from_upstream(self, out: Any) -> ProcessedPrompt:
        """A ProcessedPrompt from upstream UltravoxProcessor outputs (one sample: `input_ids` with EOS
        at the audio positions, `audio_values`, `audio_lens`, `audio_token_len`, `audio_token_start_idx`)."""
        missing = [k for k in ("input_ids", "audio_values", "audio_lens", "audio_token_len",
                               "audio_token_start_idx") if k not in out]
        if missing:
            raise ValueError(f"upstream Ultravox processor outputs lack {missing}; pass them unchanged")
        return self._to_prompt(out)

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
            raise InvalidRequest("an audio item has a chunk with no mel frames; send a non-empty clip")
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


def _referenced_map(rules, wanted, have: set[str]):
    """Key map for a referenced folder: rename by `rules`, keep what `wanted` keeps and `have` lacks."""
    def key_map(key: str) -> str | None:
        for old, new in rules:
            if key.startswith(old):
                target = wanted(new + key[len(old):])
                return None if target is None or target in have else target
        return None
    return key_map
