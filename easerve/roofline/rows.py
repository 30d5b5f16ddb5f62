"""Embedding rows (prompt placeholders) and encoder work units per media size, by each family's
processor rules, from config values alone:

- Qwen2.5-VL: the image (or each frame) is resized to multiples of patch x merge (28) keeping
  its pixel count within [min_pixels, max_pixels] ("smart resize"); patches = (H/14) x (W/14)
  per temporal step, frames are grouped in twos (temporal patch 2, an odd count padded);
  rows = patches / merge^2.
- LLaVA-NeXT ("anyres"): the best grid pinpoint for the image's size, cut into crop-size tiles
  plus one base tile; rows = the base tile's patches + the unpadded grid's patches + one newline
  row per grid row (the CLS row dropped: feature strategy "default").
- Ultravox: Whisper mel frames = samples / hop (100 per second at 16 kHz), split into 30 s
  (3000-frame; the processor's `audio_context_size` when it says) chunks; rows per chunk = ceil(frames / (2 x stack_factor)).
"""
from __future__ import annotations

import math


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = max(factor, math.floor(h / beta / factor) * factor), max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def qwen_grid(frames: int, w: int, h: int, patch: int, merge: int, temporal: int, min_pixels: int,
              max_pixels: int) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches; an image is one frame."""
    hb, wb = smart_resize(h, w, patch * merge, min_pixels, max_pixels)
    return math.ceil(frames / temporal), hb // patch, wb // patch


def best_pinpoint(h: int, w: int, pinpoints: list[list[int]]) -> tuple[int, int]:
    """The [height, width] pinpoint keeping the most of the image's resolution, then wasting the least."""
    best, best_key = None, None
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        key = (effective, -(pw * ph - effective))
        if best_key is None or key > best_key:
            best, best_key = (ph, pw), key
    return best


def llava_next_rows(w: int, h: int, pinpoints: list[list[int]], crop: int, patch: int) -> tuple[int, int]:
    """(rows, tiles) of one image of width w, height h."""
    ph, pw = best_pinpoint(h, w, pinpoints)
    sh, sw = ph // crop, pw // crop
    side = crop // patch
    cur_h, cur_w = side * sh, side * sw
    if w / h > cur_w / cur_h:
        new_h = int(round(h * (cur_w / w), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(w * (cur_h / h), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    return cur_h * cur_w + cur_h + side * side, sh * sw + 1


WHISPER_CHUNK_FRAMES = 3000


def audio_chunks(seconds: float, rate: int = 16000, hop: int = 160, chunk: int = WHISPER_CHUNK_FRAMES) -> list[int]:
    """Mel frames of each encoder-context chunk (Whisper: 30 s, 3000 frames) of a clip."""
    frames = int(round(seconds * rate)) // hop
    full, rest = divmod(frames, chunk)
    return [chunk] * full + ([rest] if rest else [])


def ultravox_rows(chunks: list[int], stack_factor: int) -> int:
    return sum(-(-f // (2 * stack_factor)) for f in chunks)
