"""Decoding user media at the gateway: images, videos and audio into what HF processors take.

Every failure raises `MediaError` (a ValueError) saying what is wrong and what is accepted,
so the gateway can return it to the client as INVALID_ARGUMENT / HTTP 400 unchanged.
Nothing here fetches URLs: remote media must arrive as bytes, base64 or data: URIs.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import wave

import numpy as np

MAX_SIDE = 8192            # pixels, per image or video frame side
MAX_FRAMES = 1024
MAX_AUDIO_SECONDS = 600.0

IMAGE_FORMATS = "PNG, JPEG, WebP, GIF, BMP or TIFF"
VIDEO_ACCEPTS = ("a list of frames (image bytes / base64 / data: URIs), an array [T, H, W, 3] "
                 "of uint8, or an animated GIF / WebP / PNG file")
AUDIO_ACCEPTS = "WAV bytes (8/16/32-bit PCM, mono or multichannel) or float samples with a sample_rate"
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class MediaError(ValueError):
    """User media that cannot be decoded; the message says what is accepted instead."""


def to_bytes(data: bytes | bytearray | memoryview | str, what: str) -> bytes:
    """Raw bytes from bytes, a base64 string or a `data:<mime>;base64,` URI."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, str):
        raw = _decode_str(data.strip(), what)
    else:
        raise MediaError(f"{what} must be bytes, a base64 string or a data: URI, got {type(data).__name__}")
    if not raw:
        raise MediaError(f"{what} is empty (0 bytes); send the file's contents")
    return raw


def _decode_str(text: str, what: str) -> bytes:
    if text.startswith(("http://", "https://", "file:")):
        raise MediaError(f"{what}: URLs are not fetched by this server; send the content inline "
                         "as a data: URI (data:<mime>;base64,...) or base64")
    m = _DATA_URI.match(text)
    if m and not m.group("b64"):
        raise MediaError(f"{what}: only base64 data: URIs are accepted (data:<mime>;base64,...)")
    payload = text[m.end():] if m else text
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64; send bytes, base64 or a data:<mime>;base64, URI") from None


# ---- images ---------------------------------------------------------------------------
def _check_size(w: int, h: int, what: str, max_side: int) -> None:
    if w < 1 or h < 1 or max(w, h) > max_side:
        raise MediaError(f"{what} is {w}x{h} pixels; each side must be between 1 and {max_side}: "
                         "resize it before sending")


def _open(raw: bytes, what: str, max_side: int):
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what} could not be decoded ({type(e).__name__}); send a {IMAGE_FORMATS} file") from None
    _check_size(*im.size, what, max_side)
    return im


def _rgb(im, what: str):
    try:
        im.load()
        return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"{what} is truncated or corrupt ({e}); send a complete {IMAGE_FORMATS} file") from None


def decode_image(data: bytes | str, max_side: int = MAX_SIDE, what: str = "image"):
    """bytes / base64 / data: URI -> PIL.Image in RGB."""
    return _rgb(_open(to_bytes(data, what), what, max_side), what)


# ---- video ----------------------------------------------------------------------------
def _check_frames(n: int, max_frames: int) -> None:
    if n == 0:
        raise MediaError(f"video has 0 frames; send {VIDEO_ACCEPTS}")
    if n > max_frames:
        raise MediaError(f"video has {n} frames; at most {max_frames} are accepted: sample fewer frames")


def _array_video(arr: np.ndarray, max_side: int, max_frames: int) -> np.ndarray:
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3, 4):
        raise MediaError(f"video array has shape {arr.shape}; expected [T, H, W, 3] (uint8 RGB)")
    _check_frames(arr.shape[0], max_frames)
    _check_size(arr.shape[2], arr.shape[1], "video frame", max_side)
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.number) or not np.isfinite(arr).all():
            raise MediaError(f"video array has dtype {arr.dtype} or non-finite values; send uint8 RGB")
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return np.ascontiguousarray(arr[..., :3])


def _file_video(raw: bytes, max_side: int, max_frames: int) -> list:
    from PIL import ImageSequence

    if raw[4:8] == b"ftyp" or raw[:4] == b"\x1aE\xdf\xa3" or (raw[:4] == b"RIFF" and raw[8:12] != b"WEBP"):
        raise MediaError("MP4 / MOV / WebM / MKV / AVI files cannot be decoded here (no video decoder "
                         f"is installed); send {VIDEO_ACCEPTS}")
    im = _open(raw, "video", max_side)
    n = getattr(im, "n_frames", 1)
    _check_frames(n, max_frames)
    return [_rgb(f.copy(), "video frame") for f in ImageSequence.Iterator(im)]


def decode_video(data, max_side: int = MAX_SIDE, max_frames: int = MAX_FRAMES):
    """Frames list / video file bytes / base64 -> list[PIL.Image]; array [T,H,W,C] -> uint8 array."""
    if isinstance(data, np.ndarray):
        return _array_video(data, max_side, max_frames)
    if isinstance(data, (list, tuple)):
        _check_frames(len(data), max_frames)
        return [decode_image(f, max_side, what=f"video frame {i}") for i, f in enumerate(data)]
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        return _file_video(to_bytes(data, "video"), max_side, max_frames)
    raise MediaError(f"video of type {type(data).__name__} is not accepted; send {VIDEO_ACCEPTS}")


# ---- audio ----------------------------------------------------------------------------
def _wav(raw: bytes) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise MediaError(f"audio could not be read as WAV ({e}); send {AUDIO_ACCEPTS}") from None
    kinds = {1: (np.uint8, 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}
    if width not in kinds:
        raise MediaError(f"WAV sample width is {8 * width} bits; send 8-, 16- or 32-bit PCM")
    dt, offset, scale = kinds[width]
    usable = len(frames) - len(frames) % (width * channels)
    x = (np.frombuffer(frames[:usable], dtype=dt).astype(np.float32) - offset) / scale
    return x.reshape(-1, channels), rate


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
    """Linear-interpolation resampling of mono float32 samples."""
    if rate == target:
        return x
    n = max(1, int(round(len(x) * target / rate)))
    t = np.arange(n, dtype=np.float64) * (rate / target)
    return np.interp(t, np.arange(len(x)), x).astype(np.float32)


def decode_audio(data, sample_rate: int | None = None, target_rate: int = 16000,
                 max_seconds: float = MAX_AUDIO_SECONDS) -> np.ndarray:
    """WAV bytes / base64 / data: URI, or float samples + sample_rate -> float32 mono at target_rate."""
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        x, rate = _wav(to_bytes(data, "audio"))
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
    if x.shape[0] / rate > max_seconds:
        raise MediaError(f"audio is {x.shape[0] / rate:.1f} s long; at most {max_seconds:.0f} s is accepted")
    return resample(x.mean(axis=1).astype(np.float32), rate, target_rate)
