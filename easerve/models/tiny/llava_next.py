"""Tiny LLaVA-NeXT checkpoint: CLIP vision tower + MLP projector + Llama LM, any-res tiling."""
from __future__ import annotations

from pathlib import Path

from easerve.models.tiny.common import (Scale, build_tokenizer, chat_template, save_model,
                                        seed_everything, special_ids, text_kwargs, token_id)

SPECIALS = ["<image>"]
# (crop size, CLIP patch size) per preset; pinpoints are 1x2, 2x1 and 2x2 crops
VISION = {"tiny": (32, 8), "bench": (224, 16)}


def pinpoints(crop: int) -> list[list[int]]:
    return [[crop, 2 * crop], [2 * crop, crop], [2 * crop, 2 * crop]]


def config(sc: Scale, tok, crop: int, patch: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    text = LlamaConfig(**text_kwargs(sc, tok))
    vision = CLIPVisionConfig(hidden_size=sc.enc_hidden, intermediate_size=sc.enc_intermediate,
                              num_hidden_layers=sc.enc_layers, num_attention_heads=sc.enc_heads,
                              image_size=crop, patch_size=patch, projection_dim=sc.enc_hidden)
    return LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=token_id(tok, "<image>"),
        image_grid_pinpoints=pinpoints(crop), vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=(crop // patch) ** 2,
        tie_word_embeddings=False, **special_ids(tok), architectures=["LlavaNextForConditionalGeneration"])


def processor(tok, crop: int, patch: int):
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    images = LlavaNextImageProcessor(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop},
                                     image_grid_pinpoints=pinpoints(crop))
    return LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=patch,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=chat_template(image="<image>"))


def build(out: Path, seed: int, scale: Scale) -> None:
    from transformers import GenerationConfig, LlavaNextForConditionalGeneration

    crop, patch = VISION["bench" if scale.hidden >= 256 else "tiny"]
    tok = build_tokenizer(SPECIALS)
    cfg = config(scale, tok, crop, patch)
    seed_everything(seed)
    model = LlavaNextForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.text_config.bos_token_id, eos_token_id=cfg.text_config.eos_token_id,
        pad_token_id=cfg.text_config.pad_token_id)
    save_model(model, out)
    processor(tok, crop, patch).save_pretrained(str(out))
