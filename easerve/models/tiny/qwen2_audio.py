"""Tiny Qwen2-Audio checkpoint: Whisper-style audio encoder (+ avg-pool) + linear projector +
Qwen2 LM. `max_source_positions=100` pairs with `WhisperFeatureExtractor(chunk_length=2)`:
every clip is padded (or cut) to 2 s = 200 mel frames, as the real model does to 30 s."""
from __future__ import annotations

from pathlib import Path

from easerve.models.tiny.common import (Scale, build_tokenizer, chat_template, save_model,
                                        seed_everything, special_ids, text_kwargs, token_id)

SPECIALS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# (max_source_positions, feature-extractor chunk seconds): tiny 2 s, bench the real 30 s
CONTEXT = {"tiny": (100, 2), "bench": (1500, 30)}


def config(sc: Scale, tok, bench: bool):
    from transformers import Qwen2AudioConfig

    text = dict(model_type="qwen2", **text_kwargs(sc, tok))
    audio = dict(model_type="qwen2_audio_encoder", d_model=sc.enc_hidden, encoder_layers=sc.enc_layers,
                 encoder_attention_heads=sc.enc_heads, encoder_ffn_dim=sc.enc_intermediate,
                 num_mel_bins=80, max_source_positions=CONTEXT["bench" if bench else "tiny"][0])
    return Qwen2AudioConfig(
        audio_config=audio, text_config=text, audio_token_index=token_id(tok, "<|AUDIO|>"),
        **special_ids(tok),
        tie_word_embeddings=False, architectures=["Qwen2AudioForConditionalGeneration"])


def processor(tok, bench: bool):
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=CONTEXT["bench" if bench else "tiny"][1])
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok,
                               chat_template=chat_template(audio=AUDIO))


def build(out: Path, seed: int, scale: Scale) -> None:
    from transformers import GenerationConfig, Qwen2AudioForConditionalGeneration

    bench = scale.hidden >= 256
    tok = build_tokenizer(SPECIALS)
    cfg = config(scale, tok, bench)
    seed_everything(seed)
    model = Qwen2AudioForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    save_model(model, out)
    processor(tok, bench).save_pretrained(str(out))
