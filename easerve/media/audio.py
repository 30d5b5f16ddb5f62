"""Audio: files (WAV, FLAC, MP3, Ogg / Opus, M4A / AAC, ... through PyAV's FFmpeg) or float
samples with their rate -> float32 mono at the model's rate, resampled by soxr (a proper
band-limited filter). Clips longer than `max_seconds` are refused, never cut.
"""
from __future__ import annotations

import io

import numpy as np

from easerve.media.common import to_bytes
from easerve.errors import MediaError

AUDIO_ACCEPTS = ("an audio file (WAV, FLAC, MP3, Ogg / Opus, M4A / AAC) or float samples "
                 "with a sample_rate")


def _too_long(seconds: float, max_seconds: float, why: str, over: bool = False) -> MediaError:
    return MediaError(f"audio is {'over ' if over else ''}{seconds:.1f} s long; at most {max_seconds:g} s per clip is accepted{why}: "
                      f"split it into clips of at most {max_seconds:g} s and send them as separate audio parts")


def _read_file(raw: bytes, max_seconds: float, why: str) -> tuple[np.ndarray, int]:
    """Decoded samples [N, C] float32 and their rate; stops as soon as the clip is too long."""
    import av

    try:
        container = av.open(io.BytesIO(raw), mode="r")
    except (av.FFmpegError, ValueError) as e:
        raise MediaError(f"audio could not be decoded ({type(e).__name__}: {e}); send {AUDIO_ACCEPTS}") from None
    with container:
        if not container.streams.audio:
            raise MediaError(f"the file has no audio stream; send {AUDIO_ACCEPTS}")
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate or stream.rate
        if not rate:
            raise MediaError("the audio file states no sample rate; re-encode it or send samples")
        stated = container.duration / 1e6 if container.duration else None  # from the header, no decoding
        if stated is not None and stated > max_seconds + 0.05:
            raise _too_long(stated, max_seconds, why)
        to_float = None
        chunks, n, limit = [], 0, int(max_seconds * rate)
        try:
            for frame in container.decode(stream):
                if to_float is None:  # planar float at the stream's own rate and channels
                    to_float = av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.sample_rate)
                for f in to_float.resample(frame):
                    chunks.append(f.to_ndarray().T)
                    n += f.samples
                if n > limit:  # the header understated it: stop decoding here
                    raise _too_long(n / rate, max_seconds, why, over=True)
            if to_float is not None:
                chunks += [f.to_ndarray().T for f in to_float.resample(None)]
        except av.FFmpegError as e:
            raise MediaError(f"audio file could not be decoded ({e}); send a complete, supported file") from None
    if not chunks:
        return np.zeros((0, 1), np.float32), int(rate)
    return np.concatenate(chunks).astype(np.float32, copy=False), int(rate)


def _samples(data) -> np.ndarray:
    try:
        x = np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError):
        raise MediaError(f"audio samples must be numbers; send {AUDIO_ACCEPTS}") from None
    if x.ndim == 1:
        return x[:, None]
    if x.ndim == 2:  # the shorter axis is channels
        return x if x.shape[1] <= x.shape[0] else x.T
    raise MediaError(f"audio samples have shape {x.shape}; send [samples] or [samples, channels]")


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 samples from `rate` to `target` Hz (soxr, high quality); identity at equal rates."""
    if rate == target:
        return x
    import soxr

    return soxr.resample(x, rate, target, quality="HQ").astype(np.float32, copy=False)


def decode_audio(data, sample_rate: int | None = None, target_rate: int = 16000,
                 max_seconds: float = 600.0, why: str = "") -> np.ndarray:
    """Audio file bytes / base64 / data: URI, or float samples + sample_rate -> float32 mono at
    `target_rate`. `why` explains the length limit in the error (e.g. the model's window)."""
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        x, rate = _read_file(to_bytes(data, "audio"), max_seconds, why)
    else:
        if not sample_rate:
            raise MediaError("audio samples need their sample_rate (e.g. 16000)")
        x, rate = _samples(data), int(sample_rate)
    if x.shape[0] == 0:
        raise MediaError(f"audio is empty (0 samples); send {AUDIO_ACCEPTS}")
    if rate <= 0:
        raise MediaError(f"audio sample rate is {rate}; it must be positive")
    if not np.isfinite(x).all():
        raise MediaError("audio samples contain NaN or infinity; send finite values in [-1, 1]")
    if x.shape[0] > max_seconds * rate:
        raise _too_long(x.shape[0] / rate, max_seconds, why)
    return resample(np.ascontiguousarray(x.mean(axis=1), dtype=np.float32), rate, target_rate)
