"""What every media decoder shares: the error type, inline payloads -> bytes, and the limits.

`MediaLimits` is the frozen set of decoding limits; `PixelBudget` is one request's running
count of decoded pixels (images and video frames together), charged *before* each
decode so that a small file cannot expand past the budget.
"""
from __future__ import annotations

import base64
import binascii
import re
import threading
from dataclasses import dataclass

from easerve.errors import MediaError

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)
URL_SCHEMES = ("http://", "https://", "file:")


def is_url(text: object) -> bool:
    """True for http(s):// and file: URLs (fetched by `MediaFetcher`), not data: URIs."""
    return isinstance(text, str) and text.lstrip()[:8].lower().startswith(URL_SCHEMES)  # no copy of a payload


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
    if is_url(text):
        raise MediaError(f"{what}: URLs are fetched by the gateway's media fetcher, not here; send the "
                         "content inline as a data: URI (data:<mime>;base64,...) or base64")
    m = _DATA_URI.match(text)
    if m and not m.group("b64"):
        raise MediaError(f"{what}: only base64 data: URIs are accepted (data:<mime>;base64,...)")
    payload = text[m.end():] if m else text
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64; send bytes, base64 or a data:<mime>;base64, URI") from None


@dataclass(frozen=True)
class MediaLimits:
    """Decoding limits of one gateway (per item unless the name says per request)."""

    max_side: int = 8192                 # pixels, per image or video frame side
    max_frames: int = 1024               # frames kept per video
    max_request_pixels: int = 256_000_000  # decoded pixels per request, all images and frames together
    max_source_frames: int = 108_000     # frames a video file may hold (1 h at 30 fps): decode work
    max_audio_seconds: float = 600.0     # per clip

    def __post_init__(self) -> None:
        for name in ("max_side", "max_frames", "max_request_pixels", "max_source_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"MediaLimits.max_audio_seconds must be > 0, got {self.max_audio_seconds}")


class PixelBudget:
    """Decoded pixels one request may still use; `take` is called before decoding."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"pixel budget must be >= 1, got {limit}")
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, pixels: int, what: str) -> None:
        """Charge `pixels`; MediaError (nothing charged) when the request would exceed its limit."""
        with self._lock:
            if self.used + pixels > self.limit:
                raise MediaError(
                    f"{what} would decode to {pixels / 1e6:.1f} Mpixels, and this request may decode at most "
                    f"{self.limit / 1e6:.1f} Mpixels of images and video frames in total "
                    f"({self.used / 1e6:.1f} already used): send smaller or fewer images, fewer frames, "
                    "or a shorter / lower-resolution video")
            self.used += pixels


def check_size(w: int, h: int, what: str, max_side: int) -> None:
    if w < 1 or h < 1 or max(w, h) > max_side:
        raise MediaError(f"{what} is {w}x{h} pixels; each side must be between 1 and {max_side}: "
                         "resize it before sending")
