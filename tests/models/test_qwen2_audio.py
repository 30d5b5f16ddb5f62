"""Qwen2-Audio adapter: split E -> P -> D greedy equals generate for clips of different
lengths, batch encode equals one by one, partial loading, bad inputs, determinism."""
from __future__ import annotations

import numpy as np
import pytest

from easerve.types import ItemMeta, PrefillRequest, items_meta

FAMILY = "qwen2-audio"
SR = 16000
# seconds per clip, in prompt order; the tiny encoder context is 2 s (longer clips are cut)
CASES = {"0.2s": [0.2], "0.77s": [0.77], "1.9s": [1.9], "2.6s-cut": [2.6], "0.3s+1.2s": [0.3, 1.2]}
PROMPT = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is this?<|im_end|>\n"



@pytest.mark.parametrize("name", list(CASES))
def test_split_greedy_equals_generate(mm, rng, full, enc, pre, name):
    messages = mm.audio_messages(rng, CASES[name])
    prompt = full.preprocess(messages)
    ref_ids, ref = mm.reference_greedy(full, messages)
    assert prompt.input_ids == ref_ids
    assert [i.modality for i in prompt.items] == ["audio"] * len(CASES[name])
    assert ref, "generate produced no tokens"
    assert mm.split_greedy(enc, pre, prompt)[:len(ref)] == ref


def test_token_count_follows_the_encoder_lengths(mm, rng, full, enc):
    items = full.preprocess(mm.audio_messages(rng, [0.2, 1.0, 2.0])).items
    tower = enc.model.model.audio_tower
    for item in items:
        _, want = tower._get_feat_extract_output_lengths(item.meta["feature_lengths"])
        assert item.num_tokens == int(want) == enc.expected_tokens("audio", item.meta)
    assert [i.num_tokens for i in items] == [5, 25, 50]


def test_batch_encode_equals_one_by_one(mm, rng, full, enc):
    items = [it for s in (0.3, 1.9, 0.05, 1.1) for it in full.preprocess(mm.audio_messages(rng, [s])).items]
    assert len({i.num_tokens for i in items}) == len(items)
    mm.assert_batched_matches_alone(enc, items)


def test_partial_loading_holds_only_the_role_weights(full, enc, pre):
    names = lambda a: {n for n, p in a.model.named_parameters() if p.device.type != "meta"}
    assert names(enc) and all(n.startswith(("model.audio_tower.", "model.multi_modal_projector."))
                              for n in names(enc))
    assert names(pre) and all(n.startswith(("model.language_model.", "lm_head.")) for n in names(pre))
    assert 0 < enc.num_parameters() < full.num_parameters()
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()


@pytest.mark.parametrize("n_clips", [0, 2])
def test_clip_placeholder_mismatch_is_rejected(mm, rng, full, n_clips):
    clips = [mm.audio(rng, 0.5) for _ in range(n_clips)]
    with pytest.raises(ValueError, match=rf"1 audio placeholder.*{n_clips} audio"):
        full.preprocess_prompt(PROMPT, audios=clips)


@pytest.mark.parametrize("bad, match", [(np.zeros(0, np.float32), "empty"),
                                        (np.zeros((2, 800), np.float32), "1-D")])
def test_bad_audio_is_rejected(mm, full, bad, match):
    with pytest.raises(ValueError, match=match):
        full.preprocess(mm.user({"type": "audio", "audio": bad}, "Hi"))
    with pytest.raises(ValueError, match=match):
        full.preprocess_prompt(PROMPT, audios=[bad])


def test_prefill_rejects_embeddings_that_do_not_fit(mm, rng, full, enc, pre):
    prompt = full.preprocess(mm.audio_messages(rng, [0.5]))
    emb = enc.encode(prompt.items)
    meta = items_meta(prompt.items)
    with pytest.raises(ValueError, match="placeholder"):  # one clip too many
        pre.prefill([PrefillRequest("extra", prompt.input_ids, emb * 2, meta * 2)])
    with pytest.raises(ValueError, match="placeholder"):  # rows for a shorter clip
        pre.prefill([PrefillRequest("short", prompt.input_ids, [emb[0][:-1]], [ItemMeta("audio", {})])])


def test_raw_prompt_matches_chat(rng, mm, full):
    a = mm.audio(rng, 0.6)
    chat = full.preprocess(mm.user({"type": "audio", "audio": a}, "What is this?"),
                           add_generation_prompt=False)
    raw = full.preprocess_prompt(PROMPT, audios=[a])
    assert raw.input_ids == chat.input_ids
    assert [i.num_tokens for i in raw.items] == [i.num_tokens for i in chat.items]


def test_same_seed_same_bytes(tmp_path):
    from easerve.models.tiny.build import make_tiny

    a, b = (make_tiny(FAMILY, tmp_path / n, seed=0) for n in ("a", "b"))
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
