"""Real video and audio files, made here with PyAV, through the gateway's content-part path
(OpenAI part -> MediaRef -> MediaResolver) give the tiny models the same greedy tokens as the
same content given as decoded frames / samples; sampling follows the model's processor."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from easerve.errors import MediaError
from easerve.media import MediaResolver, PixelBudget, VideoSampling, config_for, decode_audio, decode_video_file
from easerve.models.prompts import hf_messages
from easerve.stages.gateway import openai_api as oa
from easerve.types import ChatMessage, MediaPart, MediaRef, TextPart
from tests.models.media_clips import (AUDIO_FORMATS, VIDEO_FORMATS, decode_all_frames, encode_audio, encode_video,
                                      smooth_frames, tone)

SRC_FPS = 8


def uri(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def png_uri(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return uri(buf.getvalue(), "image/png")


def chat_tokens(full, parts: list[dict], mm) -> tuple[tuple[ChatMessage, ...], list[int]]:
    """Greedy tokens of the unsplit model for OpenAI content parts, resolved like the gateway does."""
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]}
    req = oa.parse_chat_request(body, "m", full.modalities, full.sampling_rate)
    messages = asyncio.run(MediaResolver(config_for(full)).resolve_messages(req.messages))
    return messages, mm.reference_greedy(full, hf_messages(messages), new_tokens=6)[1]


@pytest.fixture(scope="module")
def vl(adapters):
    return adapters("qwen2.5-vl", "full")


@pytest.fixture(scope="module")
def qa(adapters):
    return adapters("qwen2-audio", "full")


@pytest.fixture(scope="module")
def source_frames():
    return smooth_frames(3 * SRC_FPS, 48, 64)  # 3 s at 8 fps


# ---- video --------------------------------------------------------------------------------
def test_sampling_matches_the_hf_video_processor(vl):
    """Our indices equal Qwen2-VL's `sample_frames` for the same metadata and fps."""
    from transformers.video_utils import VideoMetadata

    vp, s = vl.processor.video_processor, config_for(vl).sampling
    assert (s.fps, s.min_frames, s.max_frames, s.frame_multiple) == (2.0, 4, 768, 2)
    for total, fps, target in [(24, 8.0, 2.0), (300, 30.0, 2.0), (301, 29.97, 1.0), (9, 4.0, 2.0), (5000, 25.0, 2.0)]:
        hf = vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=target).tolist()
        ours = VideoSampling(target, s.min_frames, s.max_frames, s.frame_multiple).indices(total, fps)
        assert ours == hf, (total, fps, target)


@pytest.mark.parametrize("fmt", list(VIDEO_FORMATS))
def test_video_file_equals_its_decoded_frames(fmt, vl, mm, source_frames):
    raw = encode_video(source_frames, fmt, fps=SRC_FPS)
    decoded = decode_all_frames(raw)  # every frame, decoded by PyAV directly
    assert decoded.shape == source_frames.shape
    lossless = fmt in ("mkv-ffv1", "mp4-h264", "webm-vp9")
    err = np.abs(decoded.astype(int) - source_frames).mean()
    assert err < (1.0 if lossless else 8.0), err  # the file holds the source (YUV rounding aside)

    messages, from_file = chat_tokens(vl, [{"type": "video_url", "video_url": {"url": uri(raw, "video/mp4")}}], mm)
    kept = messages[0].content[0].value
    assert messages[0].content[0].fps == 2.0  # the kept frames' rate, for the processor's metadata
    want = list(range(0, 24, 4))  # 3 s at the processor's 2 fps: 6 of the 24 frames
    np.testing.assert_array_equal(kept, decoded[want])
    frames = [png_uri(f) for f in decoded[want]]
    _, from_frames = chat_tokens(vl, [{"type": "video_url", "video_url": {"frames": frames}}], mm)
    assert from_file == from_frames and len(from_file) > 0
    if fmt == "mkv-ffv1":  # exact RGB round trip: the source frames themselves
        _, from_source = chat_tokens(vl, [{"type": "video_url", "video_url": {
            "frames": [png_uri(f) for f in source_frames[want]]}}], mm)
        assert from_file == from_source


def test_video_fps_option_and_limits(source_frames):
    raw = encode_video(source_frames, "mkv-ffv1", fps=SRC_FPS)
    d = decode_video_file(raw, VideoSampling(fps=4.0, frame_multiple=2))
    assert d.indices == list(range(0, 24, 2)) and d.sampled_fps == 4.0 and d.source_frames == 24
    assert decode_video_file(raw, VideoSampling(fps=None)).frames.shape == (24, 48, 64, 3)
    with pytest.raises(MediaError, match="24 frames; at most 10 are decoded"):
        decode_video_file(raw, VideoSampling(), max_source_frames=10)
    with pytest.raises(MediaError, match=r"12 sampled frames of 64x48.*at most 0\.0 Mpixels"):
        decode_video_file(raw, VideoSampling(fps=4.0, frame_multiple=2), budget=PixelBudget(64 * 48 * 11))
    with pytest.raises(MediaError, match="64x48 pixels; each side must be between 1 and 32"):
        decode_video_file(raw, VideoSampling(), max_side=32)


def test_audio_only_file_is_not_a_video():
    with pytest.raises(MediaError, match="no video stream"):
        decode_video_file(encode_audio(tone(0.2, 44100), "m4a-aac"), VideoSampling())


# ---- audio --------------------------------------------------------------------------------
def _reference_samples(raw: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """[N] float32 mono and its rate, decoded by an independent decoder where there is one:
    libsndfile (soundfile) for WAV / FLAC / MP3 / Ogg; PyAV's own for M4A."""
    if fmt != "m4a-aac":
        import soundfile as sf

        y, rate = sf.read(io.BytesIO(raw), dtype="float32", always_2d=True)
        return y.mean(1), rate
    import av

    with av.open(io.BytesIO(raw)) as c:
        chunks = [f.to_ndarray() for f in c.decode(audio=0)]  # fltp: [channels, samples]
        rate = c.streams.audio[0].rate
    return np.concatenate(chunks, 1).mean(0), rate


@pytest.mark.parametrize("fmt", list(AUDIO_FORMATS))
def test_audio_file_equals_its_decoded_samples(fmt, qa, mm):
    rate = AUDIO_FORMATS[fmt][2]
    src = tone(1.5, rate)  # stereo, within the tiny encoder's 2 s window
    raw = encode_audio(src, fmt)
    ref, ref_rate = _reference_samples(raw, fmt)
    assert ref_rate == rate
    n = min(len(ref), len(src))
    snr = 10 * np.log10(np.mean(src.mean(1)[:n] ** 2) / np.mean((ref[:n] - src.mean(1)[:n]) ** 2))
    assert snr > (60 if fmt in ("wav", "flac") else 20), snr  # the file holds the source

    ext = fmt.split("-")[0]
    messages, from_file = chat_tokens(qa, [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(raw).decode(), "format": ext}}], mm)
    clip = messages[0].content[0].value
    expect = decode_audio(ref, sample_rate=rate, target_rate=16000)
    assert clip.shape == expect.shape
    np.testing.assert_allclose(clip, expect, atol=1e-5)
    from_samples = mm.reference_greedy(qa, mm.user({"type": "audio", "audio": expect}, "Describe it."), 6)[1]
    assert from_file == from_samples and len(from_file) > 0


def test_audio_longer_than_the_qwen2_audio_window_is_refused_not_cut(qa):
    cfg = config_for(qa)
    assert cfg.audio_max_seconds == 2.0  # the tiny checkpoint's 32000-sample window
    raw = encode_audio(tone(2.5, 44100), "flac")
    with pytest.raises(MediaError, match=r"2\.5 s long; at most 2 s per clip.*qwen2-audio audio encoder's window"):
        asyncio.run(MediaResolver(cfg).resolve([MediaPart("audio", MediaRef("audio", raw))]))


def test_ultravox_splits_long_clips_itself_so_they_are_accepted(adapters):
    ux = adapters("ultravox", "processor")
    cfg = config_for(ux)
    assert cfg.audio_max_seconds is None
    part = MediaPart("audio", MediaRef("audio", encode_audio(tone(5.0, 44100), "flac")))
    (part,) = asyncio.run(MediaResolver(cfg).resolve([part]))
    (item,) = ux.preprocess([ChatMessage("user", (part, TextPart("hi")))]).items
    assert item.pixels["audio_values"].shape[0] == 3  # three 2 s windows
