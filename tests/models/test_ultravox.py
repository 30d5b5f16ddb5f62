"""Ultravox (core-class rebuild of the upstream remote code): its token rule and chunking, bad
inputs, an upstream-layout checkpoint loads without trust_remote_code (what it shares with
Qwen2-Audio: tests/models/test_audio_families.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from easerve.types import PrefillRequest, items_meta

FAMILY = "ultravox"
PROMPT = "<|im_start|>user\n<|audio|>What is this?<|im_end|>\n"


def test_upstream_token_rule_and_chunking(mm, rng, full):
    items = full.preprocess(mm.audio_messages(rng, [0.2, 0.77, 2.8])).items
    # ceil(mel frames / (2 * stack_factor)) per chunk; 2.8 s = 200 + 80 frames in 2 chunks
    assert [i.num_tokens for i in items] == [2, 5, 13 + 5]
    assert items[2].pixels["audio_values"].shape == (2, 80, 200)
    assert items[2].pixels["audio_lens"].tolist() == [200, 80]


def test_bad_audio_is_rejected(mm, full):
    with pytest.raises(ValueError, match="empty"):
        full.preprocess(mm.user({"type": "audio", "audio": np.zeros(0, np.float32)}, "Hi"))
    with pytest.raises(ValueError, match="empty"):
        full.processor(text=PROMPT, audio=[np.zeros(0, np.float32)])


def test_prefill_rejects_embeddings_that_do_not_fit(mm, rng, full, enc, pre):
    prompt = full.preprocess(mm.audio_messages(rng, [0.5]))
    emb = enc.encode(prompt.items)
    meta = items_meta(prompt.items)
    with pytest.raises(ValueError, match="placeholder"):
        pre.prefill([PrefillRequest("extra", prompt.input_ids, emb * 2, meta * 2)])
    with pytest.raises(ValueError, match="embedding rows"):
        pre.prefill([PrefillRequest("short", prompt.input_ids, [emb[0][:-1]], meta)])


def test_config_naming_a_hub_lm_without_its_config_is_rejected():
    from easerve.models.ultravox_hf import UltravoxConfig

    with pytest.raises(ValueError, match="text_model_id"):
        UltravoxConfig(text_model_id="meta-llama/Llama-3.2-1B-Instruct")


# ---- an upstream-layout checkpoint (as fixie-ai saves it), loaded with no remote code ----
LORA = {"lora_alpha": 8, "r": 0, "target_modules": ["k_proj", "q_proj", "linear_k", "linear_q"]}


def upstream_config(vocab: int, bos: int, eos: int) -> dict:
    """config.json fields as upstream writes them (v0.5: ln_mid, tied Llama 3.2 embeddings,
    the audio token one past the text vocab, auto_map pointing at the remote code)."""
    return {
        "architectures": ["UltravoxModel"], "model_type": "ultravox",
        "auto_map": {"AutoConfig": "ultravox_config.UltravoxConfig",
                     "AutoModel": "ultravox_model.UltravoxModel",
                     "AutoProcessor": "ultravox_processing.UltravoxProcessor"},
        "audio_model_id": None, "text_model_id": None, "audio_token_index": vocab,
        "hidden_size": 128, "ignore_index": -100, "initializer_range": 0.2, "norm_init": 0.4,
        "pad_token_id": eos, "projector_act": "swiglu", "projector_ln_mid": True, "stack_factor": 8,
        "audio_latency_block_size": None, "text_model_lora_config": LORA,
        "audio_model_lora_config": LORA, "torch_dtype": "bfloat16", "vocab_size": vocab,
        "transformers_version": "4.47.0",
        "audio_config": {"_name_or_path": "openai/whisper-large-v3-turbo", "model_type": "whisper",
                         "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "decoder_layers": 1, "num_mel_bins": 80,
                         "max_source_positions": 1500},
        "text_config": {"_name_or_path": "meta-llama/Llama-3.2-1B-Instruct", "model_type": "llama",
                        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "initializer_range": 0.2, "rope_theta": 500000.0, "tie_word_embeddings": True,
                        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                        "max_position_embeddings": 131072, "bos_token_id": bos, "eos_token_id": eos},
    }


@pytest.fixture(scope="module")
def upstream_dir(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import WhisperFeatureExtractor

    from easerve.models.tiny.common import build_tokenizer, chat_template, token_id
    from easerve.models.ultravox_hf import UltravoxConfig, UltravoxModel

    out = tmp_path_factory.mktemp("ultravox-upstream")
    tok = build_tokenizer([])  # like Llama 3: no <|audio|> token in the vocabulary
    tok.chat_template = chat_template(audio="<|audio|>")
    raw = upstream_config(len(tok), token_id(tok, "<s>"), token_id(tok, "<|im_end|>"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    torch.manual_seed(1)
    model = UltravoxModel(UltravoxConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "language_model.lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps(
        {"audio_padding": "longest", "encoder_ds_factor": 2, "stack_factor": 8,
         "processor_class": "UltravoxProcessor",
         "auto_map": {"AutoProcessor": "ultravox_processing.UltravoxProcessor"}}))
    return out


def test_upstream_layout_loads_without_remote_code(upstream_dir):
    from transformers import AutoModel, AutoProcessor

    from easerve.models.ultravox_hf import UltravoxModel, UltravoxProcessor

    model, info = AutoModel.from_pretrained(upstream_dir, output_loading_info=True)
    assert isinstance(model, UltravoxModel)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    lm = model.language_model
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()  # tied, as upstream
    assert model.config.text_config.rope_parameters["rope_type"] == "llama3"
    proc = AutoProcessor.from_pretrained(upstream_dir)
    assert isinstance(proc, UltravoxProcessor)
    assert proc.audio_token_id == model.config.audio_token_index == lm.config.vocab_size


def test_upstream_layout_split_equals_generate(mm, rng, upstream_dir):
    from easerve.models.loader import load_adapter

    full, enc, pre = (load_adapter(upstream_dir, role=r) for r in ("full", "encode", "prefill"))
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()
    messages = mm.audio_messages(rng, [3.1, 0.4])
    prompt = full.preprocess(messages)
    ref_ids, ref = mm.reference_greedy(full, messages)
    assert prompt.input_ids == ref_ids and ref
    assert mm.split_greedy(enc, pre, prompt)[:len(ref)] == ref
