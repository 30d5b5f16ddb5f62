"""The published checkpoints' real configs (as config.json dicts), built on the meta device: the
config layout parses to the published sizes, and partial loading's key mapping sends every key of
that layout's checkpoint (the meta model's state dict under the published names) to exactly one
role, under the module name it came from."""
from __future__ import annotations

import json

import pytest

CLIP_L_336 = {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
              "vocab_size": 32000}
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def llava_next(image_token: int, text: dict) -> dict:
    return {"architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
            "image_grid_pinpoints": PINPOINTS, "image_token_index": image_token, "model_type": "llava_next",
            "projector_hidden_act": "gelu", "text_config": text, "torch_dtype": "float16",
            "transformers_version": "4.39.0.dev0", "use_image_newline_parameter": True, "vision_config": CLIP_L_336,
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
            "vocab_size": text["vocab_size"]}


def qwen2_5_vl(hidden: int, inter: int, layers: int, heads: int, kv: int, vision_inter: int) -> dict:
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
            "video_token_id": 151656, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
            "intermediate_size": inter, "max_position_embeddings": 128000, "max_window_layers": layers,
            "model_type": "qwen2_5_vl", "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
            "use_cache": True, "use_sliding_window": False,
            "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": vision_inter,
                              "num_heads": 16, "in_chans": 3, "out_hidden_size": hidden, "patch_size": 14,
                              "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                              "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                              "temporal_patch_size": 2},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}


QWEN2_AUDIO_7B = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "audio_config": {"model_type": "qwen2_audio_encoder", "num_mel_bins": 128, "encoder_layers": 32,
                     "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "d_model": 1280,
                     "max_source_positions": 1500, "activation_function": "gelu", "dropout": 0.0},
    "audio_token_index": 151646, "ignore_index": -100, "model_type": "qwen2_audio",
    "text_config": {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
                    "intermediate_size": 11008, "max_position_embeddings": 8192, "model_type": "qwen2",
                    "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "use_mrope": False, "vocab_size": 156032},
    "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "vocab_size": 156032}
WHISPER_LARGE_V3_TURBO = {
    "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "d_model": 1280,
    "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "decoder_layers": 4,
    "decoder_attention_heads": 20, "decoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500,
    "max_target_positions": 448, "vocab_size": 51866}
LLAMA_3_1_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}


def ultravox_v0_5(audio_dir: str, text_dir: str) -> dict:
    return {"architectures": ["UltravoxModel"], "audio_latency_block_size": None, "audio_model_id": audio_dir,
            "text_model_id": text_dir, "hidden_size": 4096, "ignore_index": -100, "initializer_range": 0.02,
            "model_type": "ultravox", "norm_init": 0.4, "pad_token_id": 128009, "projector_act": "swiglu",
            "projector_ln_mid": True, "stack_factor": 8, "torch_dtype": "bfloat16",
            "transformers_version": "4.47.0", "vocab_size": 128256}


# repo -> (family, config.json, published parameter count in billions, +-)
REPOS = {
    "llava-hf/llava-v1.6-mistral-7b-hf": ("llava-next", llava_next(32000, {
        "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "architectures": ["MistralForCausalLM"],
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "torch_dtype": "bfloat16", "vocab_size": 32064}), 7.57),
    "llava-hf/llava-v1.6-34b-hf": ("llava-next", llava_next(64000, {
        "_name_or_path": "NousResearch/Nous-Hermes-2-Yi-34B", "architectures": ["LlamaForCausalLM"],
        "eos_token_id": 7, "hidden_size": 7168, "intermediate_size": 20480, "max_position_embeddings": 4096,
        "model_type": "llama", "num_attention_heads": 56, "num_hidden_layers": 60, "num_key_value_heads": 8,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 5000000.0, "torch_dtype": "bfloat16",
        "vocab_size": 64064}), 34.8),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2.5-vl", qwen2_5_vl(3584, 18944, 28, 28, 4, 3420), 8.29),
    "Qwen/Qwen2.5-VL-32B-Instruct": ("qwen2.5-vl", qwen2_5_vl(5120, 27648, 64, 40, 8, 3456), 33.5),
    "Qwen/Qwen2-Audio-7B-Instruct": ("qwen2-audio", QWEN2_AUDIO_7B, 8.4),
    "fixie-ai/ultravox-v0_5-llama-3_1-8b": ("ultravox", None, 8.7),
}


@pytest.fixture(scope="module")
def meta_models(tmp_path_factory):
    """repo -> (config, meta model): config.json written to a folder, read back with AutoConfig."""
    import transformers
    from transformers import AutoConfig

    from easerve.models.registry import adapter_class
    from easerve.models.weights import meta_skeleton

    out = {}
    for repo, (family, raw, _) in REPOS.items():
        folder = tmp_path_factory.mktemp(repo.split("/")[1])
        if family == "ultravox":
            audio, text = folder / "whisper-large-v3-turbo", folder / "Llama-3.1-8B-Instruct"
            for sub, cfg in ((audio, WHISPER_LARGE_V3_TURBO), (text, LLAMA_3_1_8B_INSTRUCT)):
                sub.mkdir()
                (sub / "config.json").write_text(json.dumps(cfg))
            raw = ultravox_v0_5(str(audio), str(text))
        (folder / "config.json").write_text(json.dumps(raw))
        config = AutoConfig.from_pretrained(str(folder))
        cls = adapter_class(family).model_class
        cls = cls if isinstance(cls, type) else getattr(transformers, raw["architectures"][0])
        out[repo] = (config, meta_skeleton(cls, config))
    return out


def tied_keys(model) -> set[str]:
    """Parameters a checkpoint leaves out because they are tied to another."""
    tie = getattr(model.config, "tie_word_embeddings", None)
    tie = model.config.get_text_config().tie_word_embeddings if tie is None else tie
    return set(getattr(type(model), "_tied_weights_keys", None) or {}) if tie else set()


def checkpoint_keys(family: str, model) -> dict[str, dict[str, str]]:
    """{folder: {published key: module name}} of the layout's checkpoint(s), from the meta model."""
    from easerve.models.tiny.published import published_key

    tied = tied_keys(model)
    names = [k for k in model.state_dict() if k not in tied]
    if family != "ultravox":
        return {"self": {published_key(family, k): k for k in names}}
    folders: dict[str, dict[str, str]] = {"self": {}, "text": {}, "audio": {}}
    for k in names:
        if k.startswith("language_model."):  # the Llama folder: model.* / lm_head.*
            folders["text"][k[len("language_model."):]] = k
        else:  # v0.5 ships its fine-tuned encoder and the projector itself
            folders["self"][k] = k
            if k.startswith("audio_tower."):  # ... and the Whisper folder has the original encoder
                folders["audio"]["model.encoder." + k[len("audio_tower."):]] = k
    folders["audio"]["model.decoder.layers.0.fc1.weight"] = None  # Whisper's decoder is no one's
    return folders


def role_maps(family: str):
    """role -> {folder: key map} as each role's partial loading reads them."""
    from easerve.models.registry import adapter_class
    from easerve.models.weights import renamer, under

    cls = adapter_class(family)
    out = {}
    for role, parts in (("encode", cls.encoder_parts), ("prefill", cls.lm_parts)):
        wanted = under(parts, renamer(cls.legacy_renames))
        maps = {"self": wanted}
        if family == "ultravox":
            from easerve.models.ultravox import _referenced_map
            maps.update({kind: _referenced_map(rules, wanted, set()) for kind, rules in cls.REFERENCED.items()})
        out[role] = maps
    return out


@pytest.mark.parametrize("repo", list(REPOS))
def test_real_config_parses_to_the_published_size(meta_models, repo):
    family, _, billions = REPOS[repo]
    config, model = meta_models[repo]
    assert all(p.device.type == "meta" for p in model.parameters())
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(n - billions) / billions < 0.06, f"{repo}: {n:.2f}B parameters, published {billions}B"
    text = config.get_text_config()
    assert tuple(model.get_input_embeddings().weight.shape) == (text.vocab_size, text.hidden_size)


@pytest.mark.parametrize("repo", list(REPOS))
def test_partial_loading_maps_every_checkpoint_key_to_one_role(meta_models, repo):
    family = REPOS[repo][0]
    _, model = meta_models[repo]
    folders, maps = checkpoint_keys(family, model), role_maps(family)
    covered: dict[str, str] = {}
    for folder, keys in folders.items():
        for key, module_name in keys.items():
            hits = {role: m[folder](key) for role, m in maps.items() if m[folder](key) is not None}
            if module_name is None:
                assert not hits, f"{repo}: {folder} key {key} is read by {sorted(hits)} but belongs to no role"
                continue
            assert len(hits) == 1, f"{repo}: {folder} key {key} is read by roles {sorted(hits)}"
            (role, target), = hits.items()
            assert target == module_name, f"{repo}: {key} loads into {target}, not {module_name}"
            covered[module_name] = role
    params = {k for k in model.state_dict()}
    assert set(covered) == params - tied_keys(model)
    assert {"encode", "prefill"} == set(covered.values())
