"""Hand-made profiles with known capacities, for the screen / format / report tests."""
from __future__ import annotations

from easerve.profile_format import (DecodePoint, EncodePoint, EncodeProfile, EncodeSizePoint, Hardware, ModelInfo,
                                   PrefillPoint, Profile, Unloaded, Versions, tiers_from)


def make_profile(encode_s_per_item: float = 0.1, prefill_tok_s: float = 1000.0, decode_tok_s: float = 2000.0,
                 devices: tuple[str, ...] = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")) -> Profile:
    """Encode: batch b takes b x encode_s_per_item at share 1.0 (no batching gain), 1.5x that at
    share 0.5; video items cost 3x an image. Prefill: prompt_len x batch / prefill_tok_s.
    Decode: a step of batch b takes b / decode_tok_s (so C_D = decode_tok_s at every batch)."""
    e = encode_s_per_item
    grid = tuple(EncodePoint(b, s, b * e * (1.0 if s == 1.0 else 1.5)) for b in (1, 2, 4) for s in (0.5, 1.0))
    by_size = (EncodeSizePoint("image", "224x224", 64, 1, e), EncodeSizePoint("video", "8x112x112", 128, 1, 3 * e))
    enc = EncodeProfile("green_contexts", "test", "image", "224x224", grid, by_size)
    prefill = tuple(PrefillPoint(L, b, L * b / prefill_tok_s) for L in (16, 64, 256) for b in (1, 2))
    decode = tuple(DecodePoint(b, b / decode_tok_s, 128) for b in (1, 8, 32))
    unloaded = (Unloaded("image", "224x224", 50, 20, 0.2, 0.01), Unloaded("video", "8x112x112", 100, 20, 0.5, 0.01),
                Unloaded("text", "", 30, 20, 0.05, 0.01))
    return Profile(Hardware("test cpu", 16, ("H200",) * len(devices), devices[0], devices),
                   Versions("0.1.0", "2.14.1", "5.24.0", "3.11"),
                   ModelInfo("/m", "qwen2.5-vl", "ab" * 32, ("image", "video")),
                   enc, prefill, decode, unloaded, tiers_from(unloaded), "2026-12-01T00:00:00Z")
