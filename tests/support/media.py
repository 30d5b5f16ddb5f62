"""Synthetic media for requests: seeded random PNG images, sine-tone WAV audio, data: URIs."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image


def png_bytes(h: int, w: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def wav_bytes(seconds: float, hz: float) -> bytes:
    import wave
    t = np.arange(int(16000 * seconds)) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def no_media_ids(model: str) -> dict[int, float]:
    """logit_bias that keeps a tiny random checkpoint (at folder `model`) from emitting its media
    placeholder ids: a mid-stream migration cannot re-prefill those as text (the gateway fails
    such a request instead of migrating it)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return {cfg[k]: -100.0 for k in ("image_token_id", "video_token_id")}


def mapped(a) -> bool:
    """Whether an array's memory is a mapping (numpy's base chain ends in a memoryview of an mmap)."""
    import mmap
    while a is not None and not isinstance(a, mmap.mmap):
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return isinstance(a, mmap.mmap)
