"""What the audio families (Qwen2-Audio, Ultravox) share: split E -> P -> D greedy equals generate
for clips of different lengths (the tiny encoder context is 2 s: Qwen2-Audio cuts longer clips,
Ultravox chunks them), batch encode equals one by one, each role loads only its weights, a clip
count that does not match the placeholders is refused, and a raw prompt equals the chat one."""
from __future__ import annotations

import pytest

AUDIO = {
    "qwen2-audio": {"cases": {"0.2s": [0.2], "0.77s": [0.77], "1.9s": [1.9], "2.6s-cut": [2.6],
                              "0.3s+1.2s": [0.3, 1.2]},
                    "batch_seconds": (0.3, 1.9, 0.05, 1.1),
                    "prompt": "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is this?<|im_end|>\n",
                    "encode": ("model.audio_tower.", "model.multi_modal_projector."),
                    "lm": ("model.language_model.", "lm_head.")},
    "ultravox": {"cases": {"0.2s": [0.2], "0.77s": [0.77], "1.9s": [1.9], "2.8s-2chunks": [2.8],
                           "0.3s+2.5s": [0.3, 2.5]},
                 "batch_seconds": (0.3, 2.7, 0.05, 1.1, 1.9),
                 "prompt": "<|im_start|>user\n<|audio|>What is this?<|im_end|>\n",
                 "encode": ("audio_tower.", "multi_modal_projector."),
                 "lm": ("language_model.",)},
}
FAMILIES = list(AUDIO)


@pytest.mark.parametrize("family, case", [(f, c) for f in AUDIO for c in AUDIO[f]["cases"]])
def test_split_greedy_equals_generate(mm, rng, adapters, family, case):
    clips = AUDIO[family]["cases"][case]
    mm.assert_audio_split_equals_generate(adapters(family, "full"), adapters(family, "encode"),
                                          adapters(family, "prefill"), mm.audio_messages(rng, clips), len(clips))


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_encode_equals_one_by_one(mm, rng, adapters, family):
    full = adapters(family, "full")
    items = [it for s in AUDIO[family]["batch_seconds"] for it in full.preprocess(mm.audio_messages(rng, [s])).items]
    assert len({i.num_tokens for i in items}) == len(items)
    mm.assert_batched_matches_alone(adapters(family, "encode"), items)


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_loading_holds_only_the_role_weights(adapters, family):
    full, enc, pre = (adapters(family, r) for r in ("full", "encode", "prefill"))
    names = lambda a: {n for n, p in a.model.named_parameters() if p.device.type != "meta"}  # noqa: E731
    assert names(enc) and all(n.startswith(AUDIO[family]["encode"]) for n in names(enc))
    assert names(pre) and all(n.startswith(AUDIO[family]["lm"]) for n in names(pre))
    assert 0 < enc.num_parameters() < full.num_parameters()
    assert enc.num_parameters() + pre.num_parameters() == full.num_parameters()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_clips", [0, 2])
def test_clip_placeholder_mismatch_is_rejected(mm, rng, adapters, family, n_clips):
    clips = [mm.audio(rng, 0.5) for _ in range(n_clips)]
    with pytest.raises(ValueError, match=rf"1 audio placeholder.*{n_clips} audio"):
        adapters(family, "full").preprocess_prompt(AUDIO[family]["prompt"], audios=clips)


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_prompt_matches_chat(rng, mm, adapters, family):
    full = adapters(family, "full")
    a = mm.audio(rng, 0.6)
    chat = full.preprocess(mm.user({"type": "audio", "audio": a}, "What is this?"), add_generation_prompt=False)
    raw = full.preprocess_prompt(AUDIO[family]["prompt"], audios=[a])
    assert raw.input_ids == chat.input_ids
    assert [i.num_tokens for i in raw.items] == [i.num_tokens for i in chat.items]
