"""Tiny checkpoints written in each published hub layout (llava-hf legacy keys, Qwen2.5-VL's
top-level text config, Qwen2-Audio, Ultravox v0.5 with audio/text model folders by reference;
sharded safetensors + index): each role loads only its own weights, the full model answers
exactly what the default layout of the same weights answers, and split E -> P -> D equals
generate. Ultravox also takes upstream UltravoxProcessor's output format."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tests.support.layouts import messages_for

FAMILIES = ("llava-next", "qwen2.5-vl", "qwen2-audio", "ultravox")
ROLE_PREFIXES = {  # family -> (encode role's parameter prefixes, LM roles')
    "llava-next": (("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline"),
                   ("model.language_model.", "lm_head.")),
    "qwen2.5-vl": (("model.visual.",), ("model.language_model.", "lm_head.")),
    "qwen2-audio": (("model.audio_tower.", "model.multi_modal_projector."), ("model.language_model.", "lm_head.")),
    "ultravox": (("audio_tower.", "multi_modal_projector."), ("language_model.",)),
}


@pytest.fixture(scope="module")
def published(tiny_root):
    from easerve.models.tiny import cached_tiny

    return lambda family: cached_tiny(family, tiny_root, layout="published")


@pytest.fixture(scope="module")
def loaded(published, adapters):
    """`loaded(family, role, layout)` -> adapter, loaded once."""
    from easerve.models.loader import load_adapter

    cache = {}

    def get(family, role, layout="published"):
        if layout == "default":
            return adapters(family, role)
        if (family, role) not in cache:
            cache[family, role] = load_adapter(published(family), role=role)
        return cache[family, role]

    return get


def held(adapter) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in adapter.model.named_parameters() if p.device.type != "meta"}


# ---- the files are the published layout ----------------------------------------------------------
def _keys(folder) -> set[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert shards == {p.name for p in folder.glob("model-*-of-*.safetensors")} and len(shards) == 3
    return set(index["weight_map"])


def test_llava_next_files_use_the_llava_hf_layout(published):
    folder = published("llava-next")
    keys, cfg = _keys(folder), json.loads((folder / "config.json").read_text())
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "multi_modal_projector",
                                                "image_newline"}
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    assert all(k.startswith("vision_tower.vision_model.") for k in keys if k.startswith("vision_tower."))
    assert cfg["text_config"]["model_type"] == "llama" and cfg["vision_config"]["model_type"] == "clip_vision_model"
    assert "rope_parameters" not in cfg["text_config"] and "image_token_index" in cfg


def test_qwen2_5_vl_files_use_the_qwen_layout(published):
    folder = published("qwen2.5-vl")
    keys, cfg = _keys(folder), json.loads((folder / "config.json").read_text())
    assert {k.split(".")[0] for k in keys} == {"model", "visual", "lm_head"}
    assert not any(k.startswith("model.language_model.") for k in keys)
    assert "text_config" not in cfg and cfg["hidden_size"] == cfg["vision_config"]["out_hidden_size"]
    assert cfg["rope_scaling"]["type"] == "mrope" and "in_chans" in cfg["vision_config"]


def test_qwen2_audio_files_use_the_qwen_layout(published):
    keys = _keys(published("qwen2-audio"))
    assert {k.split(".")[0] for k in keys} == {"language_model", "audio_tower", "multi_modal_projector"}
    assert "language_model.lm_head.weight" in keys


def test_ultravox_files_reference_the_audio_and_text_folders(published):
    from safetensors import safe_open

    folder = published("ultravox")
    cfg = json.loads((folder / "config.json").read_text())
    assert "text_config" not in cfg and "audio_config" not in cfg
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        own = set(f.keys())
    assert {k.split(".")[0] for k in own} == {"audio_tower", "multi_modal_projector"}
    text, audio = (json.loads((folder / cfg[k] / "config.json").read_text()) for k in ("text_model_id", "audio_model_id"))
    assert text["model_type"] == "llama" and audio["model_type"] == "whisper"


# ---- each role holds only its weights; outputs equal the default layout's ---------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_each_role_loads_only_its_own_weights(loaded, family):
    enc_prefixes, lm_prefixes = ROLE_PREFIXES[family]
    enc, pre, full = (loaded(family, r) for r in ("encode", "prefill", "full"))
    assert held(enc) and all(n.startswith(enc_prefixes) for n in held(enc))
    assert held(pre) and all(n.startswith(lm_prefixes) for n in held(pre))
    assert held(enc) == held(loaded(family, "encode", "default"))
    assert held(pre) == held(loaded(family, "prefill", "default"))
    assert loaded(family, "processor").model is None
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()
    for role in ("encode", "prefill"):  # same values as the default layout's, not only the same names
        a, b = loaded(family, role).model.state_dict(), loaded(family, role, "default").model.state_dict()
        for name in held(loaded(family, role)):
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_published_layout_answers_what_the_default_layout_answers(loaded, mm, family):
    rng = np.random.RandomState(3)
    messages = messages_for(family, mm, rng)
    full = loaded(family, "full")
    ref_ids, ref = mm.reference_greedy(loaded(family, "full", "default"), messages)
    ids, out = mm.reference_greedy(full, messages)
    assert ref and (ids, out) == (ref_ids, ref)
    prompt = full.preprocess(messages)
    assert prompt.input_ids == ref_ids
    assert mm.split_greedy(loaded(family, "encode"), loaded(family, "prefill"), prompt)[:len(ref)] == ref


def test_ultravox_reference_to_a_missing_folder_says_what_to_do(published, tmp_path):
    import shutil

    from easerve.models.loader import load_adapter

    copy = tmp_path / "uv"
    shutil.copytree(published("ultravox"), copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_model_id"] = "meta-llama/Llama-3.1-8B-Instruct"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="text_model_id='meta-llama/Llama-3.1-8B-Instruct', which is not a local"):
        load_adapter(copy, role="prefill")


# ---- Ultravox: upstream UltravoxProcessor's output format ----------------------------------------
def upstream_processor(proc, text: str, audios: list[np.ndarray]) -> dict:
    """Outputs in upstream UltravoxProcessor's format (fixie-ai/ultravox ultravox_processing.py, v0.5):
    mels padded to the longest clip, chunked by the encoder context; `input_ids` with the tokenizer's EOS
    token repeated ceil(mel frames / 16) times per chunk where each `<|audio|>` was; the chunks' token
    start indexes; chunks per sample."""
    fe, tok = proc.feature_extractor, proc.tokenizer
    feats = fe(audios, sampling_rate=16000, padding="longest", pad_to_multiple_of=fe.hop_length, truncation=False,
               return_attention_mask=True, return_tensors="pt")
    ctx = proc.audio_context_size
    values, lens, first = [], [], []
    for v, n in zip(feats["input_features"], feats["attention_mask"].sum(-1).tolist()):
        for off in range(0, n, ctx):
            chunk = v[:, off:off + ctx]
            values.append(torch.nn.functional.pad(chunk, (0, ctx - chunk.shape[-1])) if off else chunk)
            lens.append(min(n - off, ctx))
            first.append(off == 0)
    width = max(v.shape[-1] for v in values)
    token_len = torch.ceil(torch.tensor(lens) / (2 * proc.stack_factor)).int()
    pieces = [tok(t, add_special_tokens=False)["input_ids"] for t in text.split("<|audio|>")]
    ids, starts, piece = [], [], -1
    for k, n in enumerate(token_len.tolist()):
        if first[k]:
            piece += 1
            ids += pieces[piece]
        starts.append(len(ids))
        ids += [tok.eos_token_id] * n
    ids += pieces[piece + 1]
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "audio_values": torch.stack([torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in values]),
            "audio_lens": torch.tensor(lens), "audio_token_len": token_len,
            "audio_token_start_idx": torch.tensor(starts), "audio_batch_size": torch.tensor([len(values)])}


@pytest.mark.parametrize("layout", ["default", "published"])
def test_ultravox_accepts_the_upstream_processor_output(loaded, mm, layout):
    rng = np.random.RandomState(5)
    full = loaded("ultravox", "full", layout)
    clips = [mm.audio(rng, 0.6), mm.audio(rng, 2.7)]  # the second is two chunks of the 2 s context
    text = "<|im_start|>user\n<|audio|> and <|audio|> What is this?<|im_end|>\n<|im_start|>assistant\n"
    up = upstream_processor(full.processor, text, clips)
    assert up["input_ids"][0].tolist().count(full.tokenizer.eos_token_id) >= int(up["audio_token_len"].sum())
    ours = full.preprocess_prompt(text, audios=clips)
    got = full.from_upstream(up)
    assert got.input_ids == ours.input_ids
    assert [i.num_tokens for i in got.items] == [i.num_tokens for i in ours.items]
    for a, b in zip(got.items, ours.items):
        torch.testing.assert_close(a.pixels["audio_values"], b.pixels["audio_values"])
        assert a.pixels["audio_lens"].tolist() == b.pixels["audio_lens"].tolist()
    # the model takes upstream's kwargs as they come; the split path takes the converted prompt
    with torch.inference_mode():
        direct = full.model.generate(**up, max_new_tokens=6, do_sample=False)[0].tolist()
    ref = direct[up["input_ids"].shape[1]:]
    assert ref
    split = mm.split_greedy(loaded("ultravox", "encode", layout), loaded("ultravox", "prefill", layout), got, 6)
    assert split[:len(ref)] == ref


def test_upstream_output_with_bad_start_indexes_is_rejected(loaded, mm):
    full = loaded("ultravox", "full")
    up = upstream_processor(full.processor, "<|audio|> hi", [mm.audio(np.random.RandomState(0), 0.5)])
    up["audio_token_start_idx"] = up["audio_token_start_idx"] + 100
    with pytest.raises(ValueError, match="lies outside"):
        full.from_upstream(up)
    with pytest.raises(ValueError, match="lack"):
        full.from_upstream({"input_ids": up["input_ids"]})


def test_make_tiny_cli_writes_the_published_layout(tmp_path, capsys):
    from hasctl.cli import main

    assert main(["make-tiny", "--family", "qwen2-audio", "--layout", "published", "--out", str(tmp_path / "q")]) == 0
    assert "published layout" in capsys.readouterr().out
    assert _keys(tmp_path / "q") and json.loads((tmp_path / "q" / "config.json").read_text())["audio_token_index"]
    with pytest.raises(SystemExit):  # argparse: --layout must be one of the choices
        main(["make-tiny", "--family", "qwen2-audio", "--layout", "hub", "--out", str(tmp_path / "x")])
