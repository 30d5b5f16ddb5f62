"""LLaVA-NeXT adapter: split E -> P -> D greedy equals generate, batch encode, partial loading,
bad inputs, deterministic tiny checkpoints."""
from __future__ import annotations

import pytest
import torch

from easerve.models.registry import UnsupportedModelError
from easerve.models.loader import load_adapter
from easerve.types import ItemMeta, PrefillRequest

FAMILY = "llava-next"
# (height, width) lists: tall, wide, tiny, square, two images of different sizes in one prompt
CASES = [[(60, 90)], [(90, 30)], [(20, 20)], [(64, 64), (33, 70)]]


def prompt_of(mm, rng, sizes):
    parts = [{"type": "image", "image": mm.image(rng, h, w)} for h, w in sizes]
    return mm.user(*parts, "Describe the image.")


@pytest.mark.parametrize("sizes", CASES, ids=lambda s: "+".join(f"{h}x{w}" for h, w in s))
def test_split_greedy_equals_generate(mm, rng, full, enc, pre, sizes):
    messages = prompt_of(mm, rng, sizes)
    prompt = full.preprocess(messages)
    ref_ids, ref = mm.reference_greedy(full, messages)
    assert prompt.input_ids == ref_ids
    assert [i.modality for i in prompt.items] == ["image"] * len(sizes)
    assert ref, "generate produced no tokens"
    assert mm.split_greedy(enc, pre, prompt)[:len(ref)] == ref


def test_batch_encode_equals_one_by_one(mm, rng, full, enc):
    sizes = [(60, 90), (90, 30), (20, 20), (64, 64), (33, 70)]
    items = [it for h, w in sizes for it in full.preprocess(prompt_of(mm, rng, [(h, w)])).items]
    assert len({tuple(i.pixels["pixel_values"].shape) for i in items}) > 1  # crops differ
    mm.assert_batched_matches_alone(enc, items)


def test_partial_loading_holds_only_the_role_weights(full, enc, pre):
    names = lambda a: {n for n, p in a.model.named_parameters() if p.device.type != "meta"}
    enc_names, pre_names = names(enc), names(pre)
    assert enc_names and all(n.startswith(("model.vision_tower.", "model.multi_modal_projector.",
                                            "model.image_newline")) for n in enc_names)
    assert pre_names and all(n.startswith(("model.language_model.", "lm_head.")) for n in pre_names)
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()
    assert pre.num_parameters() > enc.num_parameters() > 0
    assert full.eos_token_ids == pre.eos_token_ids == (full.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_tied_lm_head_is_tied_not_loaded(tiny_checkpoint, tmp_path):
    from transformers import AutoConfig, AutoProcessor, LlavaNextForConditionalGeneration

    src = tiny_checkpoint(FAMILY)
    cfg = AutoConfig.from_pretrained(src)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(cfg).save_pretrained(str(tmp_path))
    AutoProcessor.from_pretrained(src).save_pretrained(str(tmp_path))
    full, enc, pre = (load_adapter(tmp_path, role=r) for r in ("full", "encode", "prefill"))
    assert pre.lm_head.weight is pre.language_model.get_input_embeddings().weight
    torch.testing.assert_close(pre.lm_head.weight, full.model.lm_head.weight)
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()


def test_legacy_hub_layout_loads(mm, rng, tiny_checkpoint, legacy_copy, full, enc, pre):
    old = legacy_copy(tiny_checkpoint(FAMILY), [
        ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline")])
    old_enc, old_pre = load_adapter(old, role="encode"), load_adapter(old, role="prefill")
    prompt = full.preprocess(prompt_of(mm, rng, [(60, 90)]))
    assert mm.split_greedy(old_enc, old_pre, prompt) == mm.split_greedy(enc, pre, prompt)


def test_processor_role_holds_no_weights(tiny_checkpoint):
    gw = load_adapter(tiny_checkpoint(FAMILY), role="processor")
    assert gw.parameters() == [] and gw.model is None
    assert gw.preprocess([{"role": "user", "content": "hi"}]).items == []
    with pytest.raises(RuntimeError, match="holds no weights"):
        gw.language_model


@pytest.mark.parametrize("n_images", [1, 3])
def test_placeholder_count_mismatch_is_rejected(mm, rng, full, n_images):
    prompt = "<|im_start|>user\n<image><image>What is this?<|im_end|>\n"
    images = [mm.image(rng, 40, 40) for _ in range(n_images)]
    with pytest.raises(ValueError, match=rf"2 image placeholder.*{n_images} image"):
        full.preprocess_prompt(prompt, images=images)


def test_raw_prompt_matches_chat_template(mm, rng, full):
    img = mm.image(rng, 50, 70)
    chat = full.preprocess(mm.user({"type": "image", "image": img}, "Hi"))
    raw = full.preprocess_prompt("<|im_start|>user\n<image>Hi<|im_end|>\n<|im_start|>assistant\n", images=[img])
    assert raw.input_ids == chat.input_ids and raw.items[0].num_tokens == chat.items[0].num_tokens


def test_unsupported_modality_is_rejected(mm, rng, full):
    with pytest.raises(ValueError, match=r"does not accept \['video'\].*accepts \['image'\]"):
        full.preprocess(mm.user({"type": "video", "video": mm.video(rng, 4, 32, 32)}, "Hi"))


def test_prefill_rejects_embeddings_that_do_not_fit(mm, rng, full, enc, pre):
    prompt = full.preprocess(prompt_of(mm, rng, [(60, 90)]))
    emb = enc.encode(prompt.items)[0]
    meta = [ItemMeta("image", prompt.items[0].meta)]
    with pytest.raises(ValueError, match=rf"{emb.shape[0] - 1} embedding rows.*needs {emb.shape[0]}"):
        pre.prefill([PrefillRequest("bad", prompt.input_ids, [emb[:-1]], meta)])
    with pytest.raises(ValueError, match="1 embeddings for 2 media items"):
        pre.prefill([PrefillRequest("bad", prompt.input_ids, [emb], meta * 2)])


def test_unsupported_architecture_names_the_supported_ones(unsupported_checkpoint):
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel|gpt2") as e:
        load_adapter(unsupported_checkpoint, role="full")
    assert "LlavaNextForConditionalGeneration" in str(e.value) and "Qwen2_5_VL" in str(e.value)
