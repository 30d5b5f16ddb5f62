"""Tiny Ultravox checkpoint in the upstream layout: Whisper encoder + stacking SwiGLU
projector (v0.5 style, `projector_ln_mid`) + Llama LM, with `UltravoxProcessor`.

The encoder context is 2 s (`max_source_positions=100` -> 200 mel frames) for `tiny`, so
clips longer than that exercise upstream's chunking; `bench` keeps Whisper's 30 s."""
from __future__ import annotations

from pathlib import Path

from easerve.models.tiny.common import (Scale, build_tokenizer, chat_template, save_model,
                                        seed_everything, special_ids, text_kwargs, token_id)

SPECIALS = ["<|audio|>"]
STACK = 8
SOURCE_POSITIONS = {"tiny": 100, "bench": 1500}


def config(sc: Scale, tok, bench: bool):
    from easerve.models.ultravox_hf import UltravoxConfig

    text = dict(model_type="llama", **text_kwargs(sc, tok))
    audio = dict(model_type="whisper", d_model=sc.enc_hidden, encoder_layers=sc.enc_layers,
                 encoder_attention_heads=sc.enc_heads, encoder_ffn_dim=sc.enc_intermediate,
                 decoder_layers=1, decoder_attention_heads=sc.enc_heads,
                 decoder_ffn_dim=sc.enc_intermediate, num_mel_bins=80,
                 max_source_positions=SOURCE_POSITIONS["bench" if bench else "tiny"])
    return UltravoxConfig(
        audio_config=audio, text_config=text, hidden_size=2 * sc.hidden, stack_factor=STACK,
        projector_act="swiglu", projector_ln_mid=True, norm_init=0.4,
        audio_token_index=token_id(tok, "<|audio|>"), architectures=["UltravoxModel"],
        **special_ids(tok))


def processor(tok, cfg):
    from transformers import WhisperFeatureExtractor

    from easerve.models.ultravox_hf import UltravoxProcessor

    ctx = 2 * cfg.audio_config.max_source_positions
    fe = WhisperFeatureExtractor(feature_size=cfg.audio_config.num_mel_bins, chunk_length=ctx // 100)
    return UltravoxProcessor(feature_extractor=fe, tokenizer=tok, stack_factor=cfg.stack_factor,
                             audio_context_size=ctx, chat_template=chat_template(audio="<|audio|>"))


def build(out: Path, seed: int, scale: Scale) -> None:
    from transformers import GenerationConfig

    from easerve.models.ultravox_hf import UltravoxModel

    bench = scale.hidden >= 256
    tok = build_tokenizer(SPECIALS)
    cfg = config(scale, tok, bench)
    seed_everything(seed)
    model = UltravoxModel(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    save_model(model, out)
    model.generation_config.save_pretrained(str(out))  # not a GenerationMixin: saved by hand
    processor(tok, cfg).save_pretrained(str(out))
