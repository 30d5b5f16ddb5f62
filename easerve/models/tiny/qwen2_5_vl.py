"""Tiny Qwen2.5-VL checkpoint: windowed ViT (patch 14, merge 2) + Qwen2 LM with M-RoPE."""
from __future__ import annotations

from pathlib import Path

from easerve.models.tiny.common import (Scale, build_tokenizer, chat_template, save_model,
                                        seed_everything, special_ids, text_kwargs, token_id)

SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PATCH, MERGE = 14, 2
# min / max pixels per image (multiples of (PATCH * MERGE)^2 = 28 * 28)
PIXELS = {"tiny": (28 * 28, 28 * 28 * 16), "bench": (28 * 28 * 4, 28 * 28 * 256)}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (t, h, w) like Qwen's 16/24/24 of 64."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def config(sc: Scale, tok, bench: bool):
    from transformers import Qwen2_5_VLConfig

    head_dim = sc.hidden // sc.heads
    text = dict(text_kwargs(sc, tok),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": mrope_section(head_dim)})
    every = max(1, sc.enc_layers // 2)
    vision = dict(depth=sc.enc_layers, hidden_size=sc.enc_hidden, intermediate_size=sc.enc_intermediate,
                  num_heads=sc.enc_heads, out_hidden_size=sc.hidden, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112 if not bench else 224,
                  fullatt_block_indexes=list(range(every - 1, sc.enc_layers, every)), tokens_per_second=2)
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=token_id(tok, "<|image_pad|>"),
        video_token_id=token_id(tok, "<|video_pad|>"),
        vision_start_token_id=token_id(tok, "<|vision_start|>"),
        vision_end_token_id=token_id(tok, "<|vision_end|>"),
        **special_ids(tok),
        tie_word_embeddings=False, architectures=["Qwen2_5_VLForConditionalGeneration"])


def processor(tok, bench: bool):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    lo, hi = PIXELS["bench" if bench else "tiny"]
    common = dict(min_pixels=lo, max_pixels=hi, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen2VLVideoProcessor(**common, cap_pixels_per_frame=True),
        tokenizer=tok, chat_template=chat_template(image=IMAGE, video=VIDEO))


def build(out: Path, seed: int, scale: Scale) -> None:
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    bench = scale.hidden >= 256
    tok = build_tokenizer(SPECIALS)
    cfg = config(scale, tok, bench)
    seed_everything(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    save_model(model, out)
    processor(tok, bench).save_pretrained(str(out))
