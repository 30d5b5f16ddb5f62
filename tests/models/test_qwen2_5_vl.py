"""Qwen2.5-VL adapter: split E -> P -> D greedy (M-RoPE, per-request rope delta) equals
generate for images and videos, batch encode, partial loading, bad inputs, determinism."""
from __future__ import annotations

import pytest
import torch

from easerve.types import ItemMeta, PrefillRequest, items_meta

FAMILY = "qwen2.5-vl"
# ("image", h, w) or ("video", frames, h, w); several per prompt are in prompt order
CASES = {
    "image-60x90": [("image", 60, 90)],
    "image-112x40": [("image", 112, 40)],
    "video-2f": [("video", 2, 56, 56)],
    "video-6f": [("video", 6, 40, 60)],
    "video-9f": [("video", 9, 56, 84)],
    "image+video+image": [("image", 30, 30), ("video", 4, 56, 56), ("image", 84, 56)],
}


def part(mm, rng, spec):
    if spec[0] == "image":
        return {"type": "image", "image": mm.image(rng, *spec[1:])}
    return {"type": "video", "video": mm.video(rng, *spec[1:])}


def messages_of(mm, rng, specs):
    return mm.user(*[part(mm, rng, s) for s in specs], "What is in the video?")


@pytest.mark.parametrize("name", list(CASES))
def test_split_greedy_equals_generate(mm, rng, full, enc, pre, name):
    messages = messages_of(mm, rng, CASES[name])
    prompt = full.preprocess(messages)
    ref_ids, ref = mm.reference_greedy(full, messages)
    assert prompt.input_ids == ref_ids
    assert [i.modality for i in prompt.items] == [s[0] for s in CASES[name]]
    assert ref, "generate produced no tokens"
    assert mm.split_greedy(enc, pre, prompt)[:len(ref)] == ref
    assert pre.model.model.rope_deltas is None  # prefill never uses the shared attribute


def test_rope_delta_is_per_request(mm, rng, full, enc, pre):
    prompts = [full.preprocess(messages_of(mm, rng, CASES[n])) for n in ("image-60x90", "video-9f")]
    reqs = [PrefillRequest(f"r{k}", p.input_ids, enc.encode(p.items),
                           items_meta(p.items)) for k, p in enumerate(prompts)]
    both = pre.prefill(reqs)
    alone = [pre.prefill([r])[0] for r in reqs]
    assert both[0].rope_delta != both[1].rope_delta and all(r.rope_delta < 0 for r in both)
    for b, a in zip(both, alone):
        assert (b.rope_delta, b.prompt_len) == (a.rope_delta, a.prompt_len)
        torch.testing.assert_close(b.last_logits, a.last_logits)
    cfg = pre.text_config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert both[1].keys[0].shape == (kv_heads, both[1].prompt_len, head_dim)


def test_decode_position_ids_layout(pre):
    pos = pre.decode_position_ids(torch.tensor([10, 20]), torch.tensor([-3, 0]))
    assert pos.shape == (4, 2, 1)  # text row, then temporal / height / width rows
    assert pos[:, :, 0].tolist() == [[10, 20], [7, 20], [7, 20], [7, 20]]


def test_batch_encode_equals_one_by_one(mm, rng, full, enc):
    specs = [("image", 60, 90), ("video", 2, 56, 56), ("image", 20, 20),
             ("video", 6, 40, 60), ("image", 112, 40)]
    items = [it for s in specs for it in full.preprocess(messages_of(mm, rng, [s])).items]
    mm.assert_batched_matches_alone(enc, items)


def test_partial_loading_holds_only_the_role_weights(full, enc, pre):
    names = lambda a: {n for n, p in a.model.named_parameters() if p.device.type != "meta"}
    assert names(enc) and all(n.startswith("model.visual.") for n in names(enc))
    assert names(pre) and all(n.startswith(("model.language_model.", "lm_head.")) for n in names(pre))
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()


def test_legacy_hub_layout_loads(mm, rng, tiny_checkpoint, legacy_copy, full, enc, pre):
    from easerve.models.loader import load_adapter

    old = legacy_copy(tiny_checkpoint(FAMILY), [("model.visual.", "visual."),
                                                ("model.language_model.", "model.")])
    old_enc, old_pre = load_adapter(old, role="encode"), load_adapter(old, role="prefill")
    prompt = full.preprocess(messages_of(mm, rng, CASES["image+video+image"]))
    assert mm.split_greedy(old_enc, old_pre, prompt) == mm.split_greedy(enc, pre, prompt)


def test_gateway_decoded_frames_feed_the_processor(mm, rng, full, enc):
    import io

    from easerve.media import decode_video

    frames = [mm.image(rng, 40, 60) for _ in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    prompt = full.preprocess(mm.user({"type": "video", "video": decode_video(buf.getvalue())}, "Hi"))
    (item,) = prompt.items
    assert item.modality == "video" and item.meta["video_grid_thw"][0] == 2  # 4 frames / 2
    assert enc.encode([item])[0].shape[0] == item.num_tokens


@pytest.mark.parametrize("fps, seconds_per_grid", [(2.0, 1.0), (4.0, 0.5)])
def test_the_frames_rate_reaches_the_temporal_positions(mm, rng, full, fps, seconds_per_grid):
    """Frames sampled at `fps` by the media decoder: Qwen2.5-VL's temporal grid spans
    temporal_patch_size / fps seconds (HF would assume 24 fps for bare frames)."""
    frames = [mm.image(rng, 40, 60) for _ in range(4)]
    with_rate = full.preprocess(mm.user({"type": "video", "video": frames, "fps": fps}, "Hi")).items[0]
    bare = full.preprocess(mm.user({"type": "video", "video": frames}, "Hi")).items[0]
    assert float(with_rate.meta["second_per_grid_ts"]) == pytest.approx(seconds_per_grid)
    assert float(bare.meta["second_per_grid_ts"]) == pytest.approx(2 / 24)


@pytest.mark.parametrize("n_videos", [0, 2])
def test_video_placeholder_mismatch_is_rejected(mm, rng, full, n_videos):
    prompt = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe<|im_end|>\n"
    videos = [mm.video(rng, 2, 28, 28) for _ in range(n_videos)]
    with pytest.raises(ValueError, match=rf"1 video placeholder.*{n_videos} video"):
        full.preprocess_prompt(prompt, videos=videos)


def test_raw_prompt_with_image_and_video(mm, rng, full):
    img, vid = mm.image(rng, 56, 56), mm.video(rng, 4, 28, 56)
    chat = full.preprocess(mm.user({"type": "video", "video": vid}, {"type": "image", "image": img}, "Hi"))
    raw = full.preprocess_prompt(
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|>"
        "<|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n", images=[img], videos=[vid])
    assert raw.input_ids == chat.input_ids
    assert [(i.modality, i.num_tokens) for i in raw.items] == [(i.modality, i.num_tokens) for i in chat.items]


def test_prefill_rejects_swapped_modalities(mm, rng, full, enc, pre):
    prompt = full.preprocess(messages_of(mm, rng, CASES["image+video+image"]))
    embs = enc.encode(prompt.items)
    meta = [ItemMeta("video" if i.modality == "image" else "image", i.meta) for i in prompt.items]
    with pytest.raises(ValueError, match="placeholder"):
        pre.prefill([PrefillRequest("bad", prompt.input_ids, embs, meta)])
