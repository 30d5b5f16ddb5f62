"""Qwen2-Audio adapter: its token count per clip, bad inputs, embeddings that do not fit (what
it shares with Ultravox: tests/models/test_audio_families.py)."""
from __future__ import annotations

import numpy as np
import pytest

from easerve.types import ItemMeta, PrefillRequest, items_meta

FAMILY = "qwen2-audio"
PROMPT = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is this?<|im_end|>\n"


def test_token_count_follows_the_encoder_lengths(mm, rng, full, enc):
    items = full.preprocess(mm.audio_messages(rng, [0.2, 1.0, 2.0])).items
    tower = enc.model.model.audio_tower
    for item in items:
        _, want = tower._get_feat_extract_output_lengths(item.meta["feature_lengths"])
        assert item.num_tokens == int(want) == enc.expected_tokens("audio", item.meta)
    assert [i.num_tokens for i in items] == [5, 25, 50]


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
