"""Gateway media decoding: what is accepted, and clear MediaErrors for what is not."""
from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
from PIL import Image

from easerve.media import PixelBudget, decode_audio, decode_image, decode_video, resample
from easerve.errors import MediaError


def png(w=12, h=8, mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color=(10, 20, 30, 255)[:len(mode)] if mode != "L" else 77).save(buf, format=fmt)
    return buf.getvalue()


def gif(frames=3, w=16, h=12) -> bytes:
    ims = [Image.new("RGB", (w, h), (40 * i, 0, 0)) for i in range(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, format="GIF", save_all=True, append_images=ims[1:], duration=40, loop=0)
    return buf.getvalue()


def wav(samples: np.ndarray, rate: int, width: int = 2) -> bytes:
    """samples [N, C] in [-1, 1] -> PCM WAV bytes."""
    dtype, scale = {2: ("<i2", 32767), 4: ("<i4", 2147483647)}[width]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes((samples * scale).astype(dtype).tobytes())
    return buf.getvalue()


# ---- images -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "JPEG"), ("RGB", "WEBP")])
def test_image_formats_decode_to_rgb(mode, fmt):
    im = decode_image(png(mode=mode, fmt=fmt))
    assert im.mode == "RGB" and im.size == (12, 8)


def test_image_from_base64_and_data_uri():
    raw = png()
    b64 = base64.b64encode(raw).decode()
    for data in (b64, f"data:image/png;base64,{b64}", f"  data:image/png;charset=x;base64,{b64}\n"):
        assert decode_image(data).size == (12, 8)


@pytest.mark.parametrize("data,match", [
    (b"\x89PNG not really an image", "could not be decoded.*PNG, JPEG"),
    (png()[:40], "truncated or corrupt|could not be decoded"),
    (b"", "empty"),
    ("not base64 !!", "not valid base64"),
    ("https://example.com/cat.png", "URLs are fetched by the gateway's media fetcher"),
    ("data:image/png,rawtext", "only base64 data: URIs"),
    (12345, "must be bytes"),
])
def test_bad_images_raise_media_error(data, match):
    with pytest.raises(MediaError, match=match):
        decode_image(data)


def test_oversize_image_is_rejected_before_decoding():
    with pytest.raises(MediaError, match=r"100x10 pixels.*between 1 and 64"):
        decode_image(png(100, 10), max_side=64)


def test_media_error_is_a_value_error():
    assert issubclass(MediaError, ValueError)


# ---- video --------------------------------------------------------------------------------
def test_video_from_frames_array_and_gif():
    frames = decode_video([png(), base64.b64encode(png()).decode()])
    assert [f.size for f in frames] == [(12, 8), (12, 8)]
    arr = decode_video(np.zeros((5, 8, 12, 3), dtype=np.float32))
    assert arr.dtype == np.uint8 and arr.shape == (5, 8, 12, 3)
    assert decode_video(np.zeros((2, 8, 12, 1), dtype=np.uint8)).shape == (2, 8, 12, 3)
    anim = decode_video(gif(frames=4))
    assert len(anim) == 4 and anim[0].mode == "RGB" and anim[0].size == (16, 12)


@pytest.mark.parametrize("data,match", [
    (np.zeros((0, 8, 8, 3), dtype=np.uint8), "0 frames"),
    ([], "0 frames"),
    (np.zeros((8, 8, 3), dtype=np.uint8), r"shape \(8, 8, 3\).*\[T, H, W, 3\]"),
    (np.full((1, 4, 4, 3), np.nan), "non-finite"),
    (b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 32, "video could not be decoded.*MP4 / MOV / WebM"),
    (b"\x00garbage", "video could not be decoded"),
    ([png(), b"garbage"], "video frame 1 could not be decoded"),
    (object(), "not accepted"),
])
def test_bad_videos_raise_media_error(data, match):
    with pytest.raises(MediaError, match=match):
        decode_video(data)


def test_video_limits():
    with pytest.raises(MediaError, match="5 frames; at most 4"):
        decode_video(np.zeros((5, 4, 4, 3), dtype=np.uint8), max_frames=4)
    with pytest.raises(MediaError, match="between 1 and 16"):
        decode_video(np.zeros((1, 4, 32, 3), dtype=np.uint8), max_side=16)


# ---- audio --------------------------------------------------------------------------------
def test_wav_stereo_16bit_downmix_and_resample():
    t = np.arange(8000) / 8000
    left, right = 0.5 * np.sin(2 * np.pi * 200 * t), np.zeros_like(t)
    x = decode_audio(wav(np.stack([left, right], 1), 8000), target_rate=16000)
    assert x.dtype == np.float32 and x.ndim == 1 and len(x) == 16000
    # band-limited resampling: away from the clip's edges, the 200 Hz tone is reproduced exactly
    np.testing.assert_allclose(x[400:-400:2], 0.25 * np.sin(2 * np.pi * 200 * t[200:-200]), atol=2e-3)


def test_resampling_filters_out_what_the_target_rate_cannot_hold():
    """A 7 kHz tone at 44.1 kHz resampled to 8 kHz (Nyquist 4 kHz) must vanish, not alias to 1 kHz
    as linear interpolation makes it."""
    t = np.arange(44100) / 44100
    y = resample((0.5 * np.sin(2 * np.pi * 7000 * t)).astype(np.float32), 44100, 8000)
    assert len(y) == 8000 and np.abs(y[200:-200]).max() < 0.01


def test_wav_32bit_and_float_samples():
    sig = np.linspace(-0.9, 0.9, 1600)[:, None]
    np.testing.assert_allclose(decode_audio(wav(sig, 16000, width=4)), sig[:, 0], atol=1e-6)
    b64 = "data:audio/wav;base64," + base64.b64encode(wav(sig, 16000)).decode()
    np.testing.assert_allclose(decode_audio(b64), sig[:, 0], atol=1e-4)
    x = decode_audio(np.ones((2, 4410)) * 0.5, sample_rate=44100, target_rate=16000)
    assert len(x) == 1600 and np.allclose(x[100:-100], 0.5, atol=1e-3)


def test_resample_is_identity_at_same_rate():
    x = np.arange(10, dtype=np.float32)
    assert resample(x, 16000, 16000) is x


@pytest.mark.parametrize("data,kwargs,match", [
    (wav(np.zeros((0, 1)), 16000), {}, "empty"),
    (b"RIFF1234WAVEjunk", {}, "audio could not be decoded.*WAV, FLAC, MP3"),
    (b"", {}, "empty"),
    ([0.1, 0.2], {}, "need their sample_rate"),
    (np.array([0.1, np.nan]), {"sample_rate": 16000}, "NaN"),
    (np.zeros((2, 2, 2)), {"sample_rate": 16000}, r"shape \(2, 2, 2\)"),
    (["a", "b"], {"sample_rate": 16000}, "must be numbers"),
    (np.zeros(16000 * 3), {"sample_rate": 16000, "max_seconds": 2}, "3.0 s long; at most 2 s.*split it"),
    (wav(np.zeros((16000 * 3, 1)), 16000), {"max_seconds": 2}, "at most 2 s per clip.*split it into clips"),
])
def test_bad_audio_raises_media_error(data, kwargs, match):
    with pytest.raises(MediaError, match=match):
        decode_audio(data, **kwargs)


def test_24bit_wav_decodes():
    buf = io.BytesIO()
    pcm = (np.linspace(-0.5, 0.5, 160) * (1 << 23)).astype("<i4")
    packed = b"".join(int(v).to_bytes(3, "little", signed=True) for v in pcm)
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(3), w.setframerate(16000), w.writeframes(packed)
    np.testing.assert_allclose(decode_audio(buf.getvalue()), np.linspace(-0.5, 0.5, 160), atol=1e-6)


# ---- the per-request pixel budget ----------------------------------------------------------
def test_pixel_budget_is_charged_before_decoding_and_spans_items():
    budget = PixelBudget(12 * 8 * 3)
    decode_image(png(12, 8), budget=budget)
    decode_video([png(12, 8)], budget=budget)
    with pytest.raises(MediaError, match=r"this request may decode at most 0\.0 Mpixels.*0\.0 already used"):
        decode_video(gif(frames=2, w=12, h=8), budget=budget)
    assert budget.used == 12 * 8 * 2  # the refused GIF charged nothing


def test_animated_gif_inside_the_size_limit_cannot_expand_past_the_budget():
    """A 1000-frame 512x512 GIF of one colour is a few kB, but 262 Mpixels decoded: refused from its header."""
    from PIL import Image

    frames = [Image.new("P", (512, 512), i % 2) for i in range(1000)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    assert len(buf.getvalue()) < 1 << 20
    with pytest.raises(MediaError, match="1000 frames of 512x512.*at most 100.0 Mpixels"):
        decode_video(buf.getvalue(), budget=PixelBudget(100_000_000), max_frames=2000)
