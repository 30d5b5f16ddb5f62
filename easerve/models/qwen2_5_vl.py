"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): images and videos, M-RoPE.

Encode = the windowed ViT over all items of a modality in one pass (packed along the
sequence, separated by `grid_thw`). Prefill computes each request's 3-D positions with
`model.model.get_rope_index` and keeps the rope delta with the request (never the
model's shared `rope_deltas`). Positions are passed as [4, B, L]: a 1-D text row (what
`generate` passes too) followed by the temporal / height / width rows.
"""
from __future__ import annotations

import torch

from easerve.models.common import HFAdapter
from easerve.errors import InvalidRequest
from easerve.types import MMItem, PrefillRequest

# modality -> (pixels key, grid key) in the processor outputs
KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


class Qwen25VLAdapter(HFAdapter):
    family = "qwen2.5-vl"
    modalities = ("image", "video")
    encoder_parts = ("model.visual",)
    placeholder_tokens = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    # Qwen hub checkpoints written before transformers 4.52 / 5
    legacy_renames = (
        (r"^visual\.", "model.visual."),
        (r"^model\.(?!language_model\.|visual\.)", "model.language_model."),
    )

    @property
    def model_class(self):
        from transformers import Qwen2_5_VLForConditionalGeneration
        return Qwen2_5_VLForConditionalGeneration

    @property
    def merge(self) -> int:
        return self.config.vision_config.spatial_merge_size

    # ---- gateway ----------------------------------------------------------------------
    def split_items(self, out, modality: str) -> list[tuple[dict, dict]]:
        """Packed patches [sum(t*h*w), D] -> each item's rows, with its grid (and fps)."""
        pkey, gkey = KEYS[modality]
        grids = out[gkey]
        ends = torch.cumsum(grids.prod(-1), 0).tolist()
        items = []
        for i, end in enumerate(ends):
            start = ends[i - 1] if i else 0
            meta = {gkey: grids[i].clone()}
            if modality == "video" and "second_per_grid_ts" in out:
                meta["second_per_grid_ts"] = torch.as_tensor(out["second_per_grid_ts"][i]).reshape(())
            items.append(({pkey: out[pkey][start:end].contiguous()}, meta))
        return items

    def expected_tokens(self, modality: str, meta: dict[str, torch.Tensor]) -> int | None:
        grid = meta.get(KEYS.get(modality, ("", ""))[1])
        return None if grid is None else int(grid.prod()) // self.merge ** 2

    # ---- encode -----------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        """Images together and videos together through the ViT; results in item order."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for mod in ("image", "video"):
            idx = [k for k, it in enumerate(items) if it.modality == mod]
            if idx:
                for k, feat in zip(idx, self._encode_group(mod, [items[k] for k in idx])):
                    out[k] = feat
        missing = sorted({items[k].modality for k, o in enumerate(out) if o is None})
        if missing:
            raise InvalidRequest(f"qwen2.5-vl encodes images and videos; got {missing} items")
        return out

    def _encode_group(self, modality: str, items: list[MMItem]) -> tuple[torch.Tensor, ...]:
        pkey, gkey = KEYS[modality]
        pixels = torch.cat([i.pixels[pkey] for i in items]).to(self.device, self.dtype)
        grids = torch.stack([i.meta[gkey] for i in items]).to(self.device)
        m = self._need_model().model
        fn = m.get_image_features if modality == "image" else m.get_video_features
        return fn(pixels, grids).pooler_output

    # ---- positions --------------------------------------------------------------------
    def _grids(self, req: PrefillRequest, modality: str) -> torch.Tensor | None:
        gkey = KEYS[modality][1]
        rows = [m.meta[gkey] for m in req.items_meta if m.modality == modality]
        return torch.stack(rows).to(self.device) if rows else None

    def prefill_positions(self, input_ids: torch.Tensor, req: PrefillRequest) -> tuple[torch.Tensor, int]:
        """[4, 1, L] positions (text row + M-RoPE rows) and this request's rope delta."""
        text = torch.arange(input_ids.shape[1], device=self.device).view(1, 1, -1)
        images, videos = self._grids(req, "image"), self._grids(req, "video")
        if images is None and videos is None:
            return text.expand(4, 1, -1), 0
        types = torch.zeros_like(input_ids, dtype=torch.int)
        types[input_ids == self.placeholder_ids["image"]] = 1
        types[input_ids == self.placeholder_ids["video"]] = 2
        secs = [m.meta["second_per_grid_ts"] for m in req.items_meta
                if m.modality == "video" and "second_per_grid_ts" in m.meta]
        pos, delta = self._need_model().model.get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=images, video_grid_thw=videos,
            second_per_grid_ts=torch.stack(secs) if secs and videos is not None else None)
        return torch.cat([text, pos]), int(delta.reshape(-1)[0])

    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """[B] text positions + [B] rope deltas -> [4, B, 1]: text row, then t/h/w rows
        (all three equal position + delta past the prompt), as `generate` passes them."""
        pos = positions.to(self.device, torch.long).view(1, -1, 1)
        mrope = pos + rope_deltas.to(self.device, torch.long).view(1, -1, 1)
        return torch.cat([pos, mrope.expand(3, -1, -1)])
