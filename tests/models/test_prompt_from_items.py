"""The gateway's encoder-cache hit path builds prompts without the HF processor
(`HFAdapter.prompt_from_items` over items the gateway's `KnownItems` learned from an earlier
preprocess): the token ids, the items' order, token counts and meta equal what the processor
gives, for every family, for chat messages and raw prompts; the media values are never read."""
from __future__ import annotations

import pytest
import torch

from easerve.cache.gateway import KnownItems

NOT_DECODED = "media not decoded: the hit path must not read it"


def _parts(mm, rng, family: str) -> list[dict]:
    if family == "qwen2.5-vl":
        return [{"type": "image", "image": mm.image(rng, 56, 42)},
                {"type": "video", "video": mm.video(rng, 4, 56, 56), "fps": 2.0},
                {"type": "text", "text": "What differs?"},
                {"type": "image", "image": mm.image(rng, 28, 70)}]
    if family == "llava-next":
        return [{"type": "image", "image": mm.image(rng, 56, 42)}, {"type": "text", "text": "And this one?"},
                {"type": "image", "image": mm.image(rng, 30, 64)}]
    return [{"type": "audio", "audio": mm.audio(rng, 1.3)}, {"type": "text", "text": "Then?"},
            {"type": "audio", "audio": mm.audio(rng, 0.4)}]


def _learned(adapter, parts: list[dict], prompt) -> dict[str, list]:
    """Hash the processed items (one distinct hash per part), learn them, and read them back per
    modality in request order, as the gateway does."""
    known = KnownItems(16, dict(adapter.placeholder_tokens))
    for k, it in enumerate(prompt.items):
        it.content_hash = bytes([k + 1]) * 32
    known.learn(prompt.items)
    by_kind: dict[str, list] = {}
    for it in prompt.items:  # prompt order = request order within each modality here
        by_kind.setdefault(it.modality, []).append(known.get(it.content_hash))
    assert all(not i.pixels for v in by_kind.values() for i in v)
    return by_kind


def _undecoded(parts: list[dict]) -> list[dict]:
    return [p if p["type"] == "text" else {"type": p["type"], p["type"]: NOT_DECODED} for p in parts]


def _same(got, want) -> None:
    assert got.input_ids == want.input_ids
    assert [(i.modality, i.num_tokens, i.content_hash) for i in got.items] == \
        [(i.modality, i.num_tokens, i.content_hash) for i in want.items]
    for g, w in zip(got.items, want.items):
        assert g.meta.keys() == w.meta.keys() and all(torch.equal(g.meta[k], w.meta[k]) for k in g.meta)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "llava-next", "qwen2-audio", "ultravox"])
def test_a_chat_prompt_from_learned_items_equals_the_processors(adapters, mm, rng, family):
    a = adapters(family, "processor")
    parts = _parts(mm, rng, family)
    full = a.preprocess(mm.user(*parts))
    known = _learned(a, parts, full)
    _same(a.prompt_from_items(a.chat_text(mm.user(*_undecoded(parts))), known, chat=True), full)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "llava-next", "qwen2-audio", "ultravox"])
def test_a_raw_prompt_from_learned_items_equals_the_processors(adapters, mm, rng, family):
    a = adapters(family, "processor")
    parts = [p for p in _parts(mm, rng, family) if p["type"] != "video"]
    mod = parts[0]["type"]
    tok = a.placeholder_tokens[mod]
    text = f"first {tok} then {tok} which?"
    full = a.preprocess_prompt(text, **{{"image": "images", "audio": "audios"}[mod]: [p[mod] for p in parts
                                                                                      if p["type"] == mod]})
    _same(a.prompt_from_items(text, _learned(a, parts, full), chat=False), full)


def test_placeholders_that_do_not_match_the_items_are_refused_with_what_to_change(adapters, mm, rng):
    a = adapters("qwen2.5-vl", "processor")
    parts = _parts(mm, rng, "qwen2.5-vl")
    known = _learned(a, parts, a.preprocess(mm.user(*parts)))
    known["image"] = known["image"][:1]
    with pytest.raises(ValueError, match=r"has 2 image placeholder\(s\) '<\|image_pad\|>' but 1 image\(s\)"):
        a.prompt_from_items(a.chat_text(mm.user(*_undecoded(parts))), known)
