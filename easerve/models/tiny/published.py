"""Tiny checkpoints in the layouts the published hub repos use: the same weight names, the same
config fields and the same sharding (`model-0000k-of-0000n.safetensors` + index) as

- llava-hf/llava-v1.6-34b-hf (and -mistral-7b-hf): `language_model.model.*`, `language_model.lm_head.*`,
  `vision_tower.vision_model.*`, `multi_modal_projector.*`, `image_newline`; a sparse `text_config`;
- Qwen/Qwen2.5-VL-7B-Instruct: `model.*`, `visual.*`, `lm_head.*`; text fields at the config's top
  level (no `text_config`), `rope_scaling: {type: mrope, ...}`, a `vision_config`;
- Qwen/Qwen2-Audio-7B-Instruct: `audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
  `language_model.lm_head.*`;
- fixie-ai/ultravox-v0_5-*: the Ultravox folder holds `audio_tower.*` + `multi_modal_projector.*` and a
  config naming `audio_model_id` / `text_model_id`; those point at two more folders written beside it
  (a Whisper checkpoint, `model.encoder.*` / `model.decoder.*`, and a Llama one, `model.*` / `lm_head.*`),
  as a user points them at local copies of openai/whisper-* and meta-llama/*.

The weights are the default tiny checkpoint's (same family + seed), renamed: a published-layout
folder must answer exactly what the default one answers.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from easerve.models.tiny.build import BUILDERS, MARKER, make_tiny

SHARDS = 3
ULTRAVOX_AUDIO, ULTRAVOX_TEXT = "whisper-encoder", "llama-text"


# ---- v5 module names -> published checkpoint names -------------------------------------------
def _prefix(rules: tuple[tuple[str, str], ...]) -> Callable[[str], str]:
    def rename(key: str) -> str:
        for old, new in rules:
            if key == old or key.startswith(old + "." if not old.endswith(".") else old):
                return new + key[len(old):]
        return key
    return rename


PUBLISHED_NAMES: dict[str, Callable[[str], str]] = {
    "llava-next": _prefix((("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                           ("model.vision_tower.", "vision_tower.vision_model."),
                           ("model.multi_modal_projector.", "multi_modal_projector."),
                           ("model.image_newline", "image_newline"))),
    "qwen2.5-vl": _prefix((("model.language_model.", "model."), ("model.visual.", "visual."))),
    "qwen2-audio": _prefix((("model.language_model.", "language_model.model."),
                            ("lm_head.", "language_model.lm_head."), ("model.audio_tower.", "audio_tower."),
                            ("model.multi_modal_projector.", "multi_modal_projector."))),
    "ultravox": lambda k: k,  # the Ultravox module names are upstream's
}


def published_key(family: str, v5_key: str) -> str:
    """The name a published checkpoint of `family` gives the transformers-5 parameter `v5_key`."""
    return PUBLISHED_NAMES[family](v5_key)


def write_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int = SHARDS) -> None:
    """`model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json`, as the hub writes."""
    keys = sorted(tensors)
    n = max(1, min(shards, len(keys)))
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {k: names[i * n // len(keys)] for i, k in enumerate(keys)}
    for name in names:
        part = {k: tensors[k].contiguous() for k in keys if weight_map[k] == name}
        save_file(part, str(out / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# ---- configs in the published field layout -----------------------------------------------------
def _pick(d: dict, keys: tuple[str, ...]) -> dict:
    return {k: d[k] for k in keys if k in d}


_LM_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "vocab_size",
              "bos_token_id", "eos_token_id", "pad_token_id")


def llava_next_config(c: dict) -> dict:
    """llava-v1.6-34b-hf's fields (its text model is a Llama; the 7B's is a Mistral, same fields)."""
    t, v = c["text_config"], c["vision_config"]
    text = {"_name_or_path": "NousResearch/Nous-Hermes-2-Yi-34B", "architectures": ["LlamaForCausalLM"],
            "model_type": "llama", "rope_theta": t["rope_parameters"]["rope_theta"], "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, **_pick(t, _LM_FIELDS)}
    vision = {"model_type": "clip_vision_model", "vocab_size": 32000,
              **_pick(v, ("hidden_size", "image_size", "intermediate_size", "num_attention_heads",
                          "num_hidden_layers", "patch_size", "projection_dim"))}
    return {"architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
            "image_grid_pinpoints": c["image_grid_pinpoints"], "image_token_index": c["image_token_index"],
            "model_type": "llava_next", "projector_hidden_act": "gelu", "text_config": text,
            "torch_dtype": "float16", "transformers_version": "4.39.0.dev0", "use_image_newline_parameter": True,
            "vision_config": vision, "vision_feature_layer": c["vision_feature_layer"],
            "vision_feature_select_strategy": c["vision_feature_select_strategy"],
            "vocab_size": t["vocab_size"], "tie_word_embeddings": False,
            **_pick(c, ("bos_token_id", "eos_token_id", "pad_token_id"))}


def qwen2_5_vl_config(c: dict) -> dict:
    """Qwen2.5-VL-7B-Instruct's fields: the LM's at the top level, `rope_scaling` type mrope."""
    t, v = c["text_config"], c["vision_config"]
    rope = t["rope_parameters"]
    vision = {"in_chans": 3, "spatial_patch_size": v["patch_size"],
              **_pick(v, ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                          "patch_size", "spatial_merge_size", "window_size", "fullatt_block_indexes",
                          "tokens_per_second", "temporal_patch_size"))}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": t["num_hidden_layers"],
            "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"], "sliding_window": 32768,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
            "use_cache": True, "use_sliding_window": False, "vision_config": vision,
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            **_pick(t, _LM_FIELDS),
            **_pick(c, ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"))}


def qwen2_audio_config(c: dict) -> dict:
    """Qwen2-Audio-7B-Instruct's fields."""
    t, a = c["text_config"], c["audio_config"]
    audio = {"model_type": "qwen2_audio_encoder", "activation_function": "gelu", "dropout": 0.0,
             **_pick(a, ("d_model", "encoder_attention_heads", "encoder_ffn_dim", "encoder_layers",
                         "num_mel_bins", "max_source_positions", "scale_embedding"))}
    text = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
            "use_mrope": False, "rope_theta": t["rope_parameters"]["rope_theta"], "tie_word_embeddings": False,
            **_pick(t, _LM_FIELDS)}
    return {"architectures": ["Qwen2AudioForConditionalGeneration"], "audio_config": audio,
            "audio_token_index": c["audio_token_index"], "ignore_index": -100, "model_type": "qwen2_audio",
            "text_config": text, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
            "vocab_size": t["vocab_size"], "tie_word_embeddings": False,
            **_pick(c, ("bos_token_id", "eos_token_id", "pad_token_id"))}


def ultravox_config(c: dict, audio_dir: Path, text_dir: Path) -> dict:
    """ultravox-v0_5's fields: the audio and text models by reference, no `audio_config` / `text_config`."""
    lora = {"lora_alpha": 8, "r": 0, "target_modules": ["k_proj", "q_proj", "linear_k", "linear_q"]}
    return {"architectures": ["UltravoxModel"], "audio_latency_block_size": None,
            "audio_model_id": str(audio_dir.resolve()), "text_model_id": str(text_dir.resolve()),
            "audio_model_lora_config": lora, "text_model_lora_config": lora,
            "auto_map": {"AutoConfig": "ultravox_config.UltravoxConfig", "AutoModel": "ultravox_model.UltravoxModel",
                         "AutoProcessor": "ultravox_processing.UltravoxProcessor"},
            "hidden_size": c["hidden_size"], "ignore_index": -100, "initializer_range": 0.02,
            "model_type": "ultravox", "norm_init": c["norm_init"], "pad_token_id": c["pad_token_id"],
            "projector_act": c["projector_act"], "projector_ln_mid": c["projector_ln_mid"],
            "stack_factor": c["stack_factor"], "torch_dtype": "bfloat16", "transformers_version": "4.47.0",
            "vocab_size": c["text_config"]["vocab_size"]}


CONFIGS = {"llava-next": llava_next_config, "qwen2.5-vl": qwen2_5_vl_config, "qwen2-audio": qwen2_audio_config}


# ---- builders ----------------------------------------------------------------------------------
def _v5_state(family: str, src: Path) -> dict[str, torch.Tensor]:
    """The default tiny checkpoint's parameters under their transformers-5 module names."""
    import transformers

    arch = json.loads((src / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(src), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy(f, out / f.name)


def make_published(family: str, out: str | Path, seed: int = 0, scale: str = "tiny") -> Path:
    """Write the tiny `family` checkpoint of `seed` to `out` in its published hub layout."""
    if family not in BUILDERS:
        raise ValueError(f"unknown --family {family!r}; choose one of {sorted(BUILDERS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="easerve-tiny-") as tmp:
        src = make_tiny(family, Path(tmp) / "v5", seed=seed, scale=scale)
        config = json.loads((src / "config.json").read_text())
        if family == "ultravox":
            _write_ultravox(src, config, out)
        else:
            state = _v5_state(family, src)
            write_sharded({published_key(family, k): v for k, v in state.items()}, out)
            (out / "config.json").write_text(json.dumps(CONFIGS[family](config), indent=2) + "\n")
            _copy_side_files(src, out)
            legacy_processor_files(out)
    (out / MARKER).write_text(json.dumps({"family": family, "seed": seed, "scale": scale,
                                          "layout": "published"}) + "\n")
    return out


# sub-processor entry of a transformers-5 processor_config.json -> its file in the published repos
_SUB_FILES = {"image_processor": "preprocessor_config.json", "feature_extractor": "preprocessor_config.json",
              "video_processor": "video_preprocessor_config.json"}


def legacy_processor_files(out: Path) -> None:
    """Rewrite a transformers-5 processor folder as the published repos keep it: each sub-processor
    in its own file (`preprocessor_config.json`, ...) naming `processor_class`, Qwen's pixel budget as
    `min_pixels` / `max_pixels`, and the chat template in `chat_template.json`."""
    proc = json.loads((out / "processor_config.json").read_text())
    cls = proc["processor_class"]
    for key, name in _SUB_FILES.items():
        if key in proc:
            sub = {**proc.pop(key), "processor_class": cls}
            size = sub.get("size", {})
            if "min_pixels" not in sub and {"shortest_edge", "longest_edge"} <= set(size):
                sub.update(min_pixels=sub.pop("size")["shortest_edge"], max_pixels=size["longest_edge"])
            (out / name).write_text(json.dumps(sub, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
    template = out / "chat_template.jinja"
    if template.is_file():
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template.read_text()}) + "\n")
        template.unlink()


def _write_ultravox(src: Path, config: dict, out: Path) -> None:
    """Ultravox folder + the Whisper and Llama folders its config names."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, WhisperConfig, WhisperForConditionalGeneration

    from easerve.models.weights import read_tensors

    state = read_tensors(src, lambda k: k)
    audio_dir, text_dir = out / ULTRAVOX_AUDIO, out / ULTRAVOX_TEXT
    # the Llama the config names: its own folder, config and tokenizer (with chat template)
    text_cfg = LlamaConfig(**{k: v for k, v in config["text_config"].items() if k != "model_type"})
    lm = LlamaForCausalLM(text_cfg)
    lm.load_state_dict({k[len("language_model."):]: v for k, v in state.items() if k.startswith("language_model.")})
    lm.generation_config = GenerationConfig.from_pretrained(str(src))
    lm.save_pretrained(str(text_dir))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, text_dir / f)
    # the Whisper the config names: encoder = the tiny audio tower, a random 1-layer decoder
    whisper = WhisperForConditionalGeneration(WhisperConfig(**{k: v for k, v in config["audio_config"].items()
                                                               if k != "model_type"}))
    enc = {k[len("audio_tower."):]: v for k, v in state.items() if k.startswith("audio_tower.")}
    whisper.model.encoder.load_state_dict(enc)
    whisper.save_pretrained(str(audio_dir))
    # the Ultravox folder: its own (fine-tuned) encoder and the projector; LM weights by reference
    own = {k: v for k, v in state.items() if k.startswith(("audio_tower.", "multi_modal_projector."))}
    save_file({k: v.contiguous() for k, v in own.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(ultravox_config(config, audio_dir, text_dir), indent=2) + "\n")
    _copy_side_files(src, out)
    proc = json.loads((out / "processor_config.json").read_text())
    proc.update({"audio_padding": "longest", "encoder_ds_factor": 2})  # upstream's processor fields
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
