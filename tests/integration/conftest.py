"""Real stacks of real processes on 127.0.0.1 free ports, started once per session."""
from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from easerve.models.tiny import cached_tiny
from hasctl.deployment import preset
from hasctl.launch import Stack, free_port


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    root = os.environ.get("EASERVE_TINY_CACHE")
    return root or str(tmp_path_factory.mktemp("tiny"))


def _stack(model: str, preset_name: str, **stage_flags) -> Stack:
    d = preset(preset_name).with_model(model).with_gateway_ports(0, 0)  # 0: free ports
    for stage, flags in stage_flags.items():
        d = d.with_flags(stage, **flags)
    return Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})


@pytest.fixture(scope="session")
def vl_stack(tiny_root):
    """Qwen2.5-VL (image + video), co-located prefill with s = 0.5: both prefill paths live."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    stack = _stack(model, "colocated", decode={"max_seq_len": 4096, "num_slots": 8, "threads": 1},
                   encode={"threads": 1, "metrics_listen": f"127.0.0.1:{free_port()}"}, prefill={"threads": 1})
    stack.start(timeout=420)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def audio_stack(tiny_root):
    model = str(cached_tiny("qwen2-audio", tiny_root))
    stack = _stack(model, "default", decode={"threads": 1}, encode={"threads": 1}, prefill={"threads": 1})
    stack.start(timeout=420)
    yield stack
    stack.stop()


def no_media_ids(model: str) -> dict[int, float]:
    """logit_bias that keeps a tiny random checkpoint (at folder `model`) from emitting its media
    placeholder ids: a mid-stream migration cannot re-prefill those as text (the gateway fails
    such a request instead of migrating it)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return {cfg[k]: -100.0 for k in ("image_token_id", "video_token_id")}


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
