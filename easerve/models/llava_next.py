"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): images only, any-resolution tiling.

Encode = CLIP tower over every crop of every image in one pass, projector, then HF's
`pack_image_features` (unpad + image_newline) per image: `model.model.get_image_features`.
"""
from __future__ import annotations

import torch

from easerve.models.common import HFAdapter
from easerve.errors import InvalidRequest
from easerve.types import MMItem


class LlavaNextAdapter(HFAdapter):
    family = "llava-next"
    modalities = ("image",)
    encoder_parts = ("model.vision_tower", "model.multi_modal_projector", "model.image_newline")
    placeholder_tokens = {"image": "<image>"}
    # llava-hf hub checkpoints written before transformers 4.52 / 5
    legacy_renames = (
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^language_model\.model\.", "model.language_model."),
        (r"^vision_tower\.vision_model\.", "model.vision_tower."),
        (r"^vision_tower\.", "model.vision_tower."),
        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
        (r"^image_newline$", "model.image_newline"),
    )

    @property
    def model_class(self):
        from transformers import LlavaNextForConditionalGeneration
        return LlavaNextForConditionalGeneration

    def _num_patches(self, image_size: torch.Tensor) -> int:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches
        return image_size_to_num_patches(image_size.tolist(), self.config.image_grid_pinpoints,
                                         self.config.vision_config.image_size)

    def split_items(self, out, modality: str) -> list[tuple[dict, dict]]:
        """pixel_values [N, max_crops, C, H, W] (zero-padded) -> each image's own crops."""
        pv, sizes = out["pixel_values"], out["image_sizes"]
        return [({"pixel_values": pv[i, :self._num_patches(sizes[i])].contiguous()},
                 {"image_sizes": sizes[i].clone()}) for i in range(len(sizes))]

    def expected_tokens(self, modality: str, meta: dict[str, torch.Tensor]) -> int | None:
        if modality != "image" or "image_sizes" not in meta:
            return None
        h, w = (int(x) for x in meta["image_sizes"])
        crop = self.config.vision_config.image_size
        n = self.processor._get_number_of_features(h, w, crop, crop)
        return n - 1 if self.config.vision_feature_select_strategy == "default" else n

    @torch.inference_mode()
    def encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        """All crops of all images through the tower at once; one [tokens, hidden] per image."""
        if not items:
            return []
        bad = [i.modality for i in items if i.modality != "image"]
        if bad:
            raise InvalidRequest(f"llava-next encodes images only; got {sorted(set(bad))} items")
        pixels = torch.cat([i.pixels["pixel_values"] for i in items]).to(self.device, self.dtype)
        sizes = torch.stack([i.meta["image_sizes"] for i in items]).to(self.device)
        feats = self._need_model().model.get_image_features(pixels, sizes).pooler_output
        return list(feats)
