"""Media files made in the test with PyAV (its bundled FFmpeg encoders): video and audio clips."""
from __future__ import annotations

import io

import numpy as np

# name -> (container format, codec, pix_fmt, encoder options)
VIDEO_FORMATS = {
    "mp4-h264": ("mp4", "libx264", "yuv444p", {"qp": "0", "preset": "ultrafast"}),
    "webm-vp9": ("webm", "libvpx-vp9", "yuv444p", {"lossless": "1", "deadline": "realtime", "cpu-used": "8"}),
    "mkv-ffv1": ("matroska", "ffv1", "bgr0", {}),  # exact RGB round trip
    "mkv-av1": ("matroska", "libsvtav1", "yuv420p", {"crf": "10", "preset": "12"}),
    "mov-h264": ("mov", "libx264", "yuv420p", {"crf": "12", "preset": "ultrafast"}),
}
# name -> (container format, codec, sample rate, encoder options)
AUDIO_FORMATS = {
    "wav": ("wav", "pcm_s16le", 44100, {}),
    "flac": ("flac", "flac", 44100, {}),
    "mp3": ("mp3", "libmp3lame", 44100, {"b": "192k"}),
    "ogg-opus": ("ogg", "libopus", 48000, {"b": "128k"}),
    "m4a-aac": ("ipod", "aac", 44100, {"b": "192k"}),
}


def smooth_frames(n: int, h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    """[n, h, w, 3] uint8: moving gradients plus mild noise (compressible, not constant)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for t in range(n):
        r = 128 + 100 * np.sin((x + 3 * t) / 9.0)
        g = 128 + 100 * np.cos((y - 2 * t) / 7.0)
        b = 128 + 90 * np.sin((x + y + 5 * t) / 13.0)
        out.append(np.stack([r, g, b], -1) + rng.normal(0, 4, (h, w, 3)))
    return np.clip(np.array(out), 0, 255).astype(np.uint8)


def encode_video(frames: np.ndarray, fmt: str, fps: int = 8) -> bytes:
    container, codec, pix_fmt, opts = VIDEO_FORMATS[fmt]
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as c:
        s = c.add_stream(codec, rate=fps, options=dict(opts))
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for arr in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def decode_all_frames(raw: bytes) -> np.ndarray:
    """Every frame PyAV decodes from `raw`, RGB [T, H, W, 3] (the independent reference)."""
    import av

    with av.open(io.BytesIO(raw)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def tone(seconds: float, rate: int, channels: int = 2, seed: int = 0) -> np.ndarray:
    """[N, channels] float32 in [-1, 1]: two tones and a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    base = 0.4 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)
    chans = [base * (1 - 0.3 * c) + 0.01 * rng.standard_normal(t.shape) for c in range(channels)]
    return np.stack(chans, 1).astype(np.float32)


def encode_audio(samples: np.ndarray, fmt: str) -> bytes:
    """[N, C] float32 -> an encoded file (16-bit for PCM / FLAC)."""
    container, codec, rate, opts = AUDIO_FORMATS[fmt]
    import av

    layout = {1: "mono", 2: "stereo"}[samples.shape[1]]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as c:
        s = c.add_stream(codec, rate=rate, options=dict(opts))
        s.layout = layout
        fmt_in = {"pcm_s16le": "s16", "flac": "s16", "libopus": "flt"}.get(codec, "fltp")
        s.format = fmt_in
        step = 960 if codec == "libopus" else 1024
        for i in range(0, len(samples), step):
            chunk = samples[i:i + step]
            if fmt_in == "s16":
                arr = (np.clip(chunk, -1, 1) * 32767).astype(np.int16).reshape(1, -1)
            elif fmt_in == "flt":
                arr = np.ascontiguousarray(chunk).reshape(1, -1)
            else:
                arr = np.ascontiguousarray(chunk.T)
            frame = av.AudioFrame.from_ndarray(arr, format=fmt_in, layout=layout)
            frame.sample_rate, frame.pts = rate, i
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()
