"""Multimodal chat messages per model family for the checkpoint-layout tests."""
from __future__ import annotations




def messages_for(family: str, mm, rng) -> list[dict]:
    if family == "llava-next":
        return mm.user({"type": "image", "image": mm.image(rng, 40, 72)}, "Describe the image.")
    if family == "qwen2.5-vl":
        return mm.user({"type": "image", "image": mm.image(rng, 56, 84)},
                       {"type": "video", "video": mm.video(rng, 4, 56, 56)}, "What is in both?")
    return mm.audio_messages(rng, [0.7, 2.6] if family == "ultravox" else [0.7])
