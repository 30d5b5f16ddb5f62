"""Hypothesis strategies for malformed requests, one per family, and the media they break.

Every value drawn here is invalid by construction (a test fails if the server accepts one):
the family names what makes it so. Shared by the HTTP and the gRPC fuzz tests.
"""
from __future__ import annotations

import base64
import collections
import json
import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hasctl.workload import wav as workload_wav

from tests.support.media import png_bytes

# ---- media, valid and broken ---------------------------------------------------------------


def wav_bytes(seconds: float = 0.25, rate: int = 16000) -> bytes:
    """A valid 16-bit mono WAV (the load client's own generator)."""
    return workload_wav(seconds, seed=0, rate=rate)


def mp4_bytes(frames: int = 4) -> bytes:
    from tests.models.media_clips import encode_video, smooth_frames
    return encode_video(smooth_frames(frames, 48, 64), "mp4-h264", fps=4)


PNG = png_bytes(32, 32, 1)
WAV = wav_bytes()
MP4 = mp4_bytes()
MEDIA = {"png": PNG, "wav": WAV, "mp4": MP4}
MIME = {"png": "image/png", "wav": "audio/wav", "mp4": "video/mp4"}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_uri(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64,{b64(raw)}"


def truncated(kind: str):
    """The file cut short where no decoder can recover it: PNG inside its image data (one cut only
    in the trailing IEND chunk leaves every pixel there), MP4 anywhere before its index (the moov
    box, written last), WAV inside its header (a WAV cut in its samples is a shorter, valid WAV)."""
    raw = MEDIA[kind]
    top = {"wav": 44, "png": len(raw) - 24, "mp4": len(raw) - 8}[kind]
    return st.integers(1, top).map(lambda n: raw[:n])


def corrupted(kind: str):
    """The file with its signature overwritten (PNG: the 8-byte magic), or (MP4) its boxes after the
    32-byte ftyp replaced by junk: no decoder can take it. (Junk inside the compressed payload is not
    used: decoders conceal it, rightly.)"""
    raw = MEDIA[kind]
    if kind == "png":
        return st.binary(min_size=8, max_size=8).filter(lambda b: b != raw[:8]).map(lambda b: b + raw[8:])
    return st.binary(min_size=1, max_size=4000).map(lambda junk: raw[:32] + junk)


broken_base64 = st.one_of(
    st.text(alphabet="!@#$%^&*()<>?~ ", min_size=1, max_size=40),
    st.binary(min_size=1, max_size=64).map(lambda b: b64(b)[:-1] + "!"),  # one bad character
    st.binary(min_size=2, max_size=64).map(lambda b: b64(b).rstrip("=") + "="),  # bad padding
    st.just("data:image/png;base64,@@@@"),
    st.just("data:image/png,not-base64-at-all"),  # a non-base64 data: URI
)

# ---- numbers --------------------------------------------------------------------------------
HUGE = [2 ** 64, 2 ** 70, 10 ** 30, 1e300]
NONFINITE = [math.nan, math.inf, -math.inf]


def bad_number(field: str):
    """(field, value) pairs that are out of range or not finite for `field`."""
    ranges = {
        "max_tokens": st.sampled_from([0, -1, -(2 ** 63), 2 ** 33, 2 ** 70, 1.5, math.nan]),
        "max_completion_tokens": st.sampled_from([0, -5, 2 ** 40, math.inf]),
        "temperature": st.sampled_from([-0.1, -1e9, 2.5, 1e300, *NONFINITE]),
        "top_p": st.sampled_from([0.0, -0.5, 1.5, 1e10, *NONFINITE]),
        "top_k": st.sampled_from([-2, -(2 ** 40), 2 ** 40, 0.5]),
        "seed": st.sampled_from([2 ** 64, -(2 ** 64), 10 ** 30, 1.25, math.nan]),
        "timeout": st.sampled_from([0, -1.0, 1e9, *NONFINITE]),
        "top_logprobs": st.sampled_from([-1, 21, 2 ** 31]),
        "presence_penalty": st.sampled_from([-3.0, 5.0, *NONFINITE]),
        "n": st.sampled_from([0, -1, 17, 2 ** 40]),  # 1..16 choices
    }
    return ranges[field].map(lambda v: (field, v))


def dumps(body) -> bytes:
    """JSON as a client might send it: NaN / Infinity written as JS literals (json's default)."""
    return json.dumps(body).encode()


# ---- tallies --------------------------------------------------------------------------------
class Tally:
    """Requests sent and statuses seen per family, for the figures in docs/reliability."""

    def __init__(self) -> None:
        self.sent: collections.Counter = collections.Counter()
        self.status: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, family: str, status) -> None:
        self.sent[family] += 1
        self.status[family][str(status)] += 1

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def table(self) -> str:
        rows = [f"{f:28s} {n:5d}  " + ", ".join(f"{s}x{c}" for s, c in sorted(self.status[f].items()))
                for f, n in sorted(self.sent.items())]
        return "\n".join(rows + [f"{'total':28s} {self.total:5d}"])


def fuzz(n: int):
    """Hypothesis settings of a fuzz test: n examples, derandomized (the same cases every run),
    no deadline, no example database, every health check off."""
    return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))
