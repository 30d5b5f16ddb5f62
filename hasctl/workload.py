"""Workloads for `hasctl bench`: seeded arrival times and synthetic (or replayed) chat requests.

Arrivals (DESIGN §6): Poisson at rate λ (exponential gaps of mean 1/λ), or gamma gaps with
burstiness K: shape K, scale 1/(λK), so the mean gap stays 1/λ and the squared coefficient of
variation is 1/K (K < 1 burstier than Poisson, K > 1 smoother; K = 1 is Poisson). The first
request goes at t = 0; every later one after one gap. Same seed, same times.

Requests are OpenAI chat messages with synthetic media of a chosen size: an image is a PNG of
W x H (a seeded smooth pattern, unique per request so no server-side media cache can hit), a
video is F such frames, sent as an animated GIF data: URI (`video_format="gif"`) or as
`{"frames": [PNG data URIs]}` (`"frames"`, EAServe's extension), audio is a 16 kHz 16-bit mono
WAV of S seconds, and text is about N tokens of common English words (one word is one token in
the usual BPE vocabularies, give or take). "mixed" draws each request's modality from `mix`
(seeded, uniform).

Dataset replay (`load_dataset`): a JSONL file, one request per line, an object with
  "messages": OpenAI chat messages, sent as they are        (or "prompt": a string, sent as
                                                            one user text message)
  "max_tokens" (optional, int >= 1): output tokens asked for; default: the workload's
  "modality"   (optional, str): label for per-modality metrics; default: guessed from the parts
Blank lines and lines starting with '#' are skipped. Pure: no network; the only I/O is
`load_dataset` reading its file.
"""
from __future__ import annotations

import base64
import io
import json
import math
import random
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

MODALITIES = ("image", "video", "audio", "text", "mixed")
MEDIA = ("image", "video", "audio")
VIDEO_FORMATS = ("gif", "frames")
AUDIO_RATE = 16000
_PART_MODALITY = {"image_url": "image", "video_url": "video", "input_audio": "audio"}
_WORDS = ("the of and to in is was for on that with as by at from it an be this are or have not had "
          "but what all were when we there can more if out so up said about into than them only "
          "other new some time could these two may first then do any like my now over such our man "
          "me even most made after also did many before must through back years where much your "
          "way well down should because each just those people how too little state good very make "
          "world still own see men work long get here between both life being under never day same "
          "another know while last might us great old year off come since against go came right "
          "used take three").split()


# ---- arrivals ------------------------------------------------------------------------------
def _check_rate(rate: float, burstiness: float) -> None:
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    if not (isinstance(burstiness, (int, float)) and math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness K must be > 0 (1 = Poisson, < 1 burstier), got {burstiness!r}")


def gaps(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless seeded inter-arrival gaps (s): exponential for K == 1, else gamma(K, 1/(rate K))."""
    _check_rate(rate, burstiness)
    rng = random.Random(seed)
    while True:
        if burstiness == 1.0:
            yield rng.expovariate(rate)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_times(rate: float, burstiness: float = 1.0, seed: int = 0, *, n: int | None = None,
                  duration_s: float | None = None) -> list[float]:
    """Send times (s from the start): the first n, or all that fall before duration_s."""
    if (n is None) == (duration_s is None):
        raise ValueError("give exactly one of n (number of requests) or duration_s")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    out, t, it = [], 0.0, gaps(rate, burstiness, seed)
    while (n is None or len(out) < n) and (duration_s is None or t < duration_s):
        out.append(t)
        t += next(it)
    return out


def steady_requests(rate: float, at_least: int, min_duration_s: float) -> int:
    """Requests of a run that reaches steady state: `at_least`, or `min_duration_s` of arrivals
    at `rate` if more (a fixed count at a high rate is a burst that ends before the queues
    build, and scores a rate no deployment sustains)."""
    return max(at_least, math.ceil(rate * min_duration_s))


# ---- requests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadSpec:
    """What each synthetic request holds. Sizes: image/video frame (width, height) px."""

    modality: str = "image"
    image_size: tuple[int, int] = (224, 224)
    video_frames: int = 8
    video_size: tuple[int, int] = (112, 112)
    video_format: str = "gif"
    audio_s: float = 2.0
    input_tokens: int = 32
    output_tokens: int = 32
    mix: tuple[str, ...] = ("image", "video", "audio", "text")

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {self.modality!r}")
        for name in ("image_size", "video_size"):
            v = getattr(self, name)
            if (not isinstance(v, tuple) or len(v) != 2
                    or not all(isinstance(x, int) and 1 <= x <= 8192 for x in v)):
                raise ValueError(f"{name} must be (width, height) with sides in 1..8192, got {v!r}")
        if not 1 <= self.video_frames <= 1024:
            raise ValueError(f"video_frames must be in 1..1024, got {self.video_frames}")
        if self.video_format not in VIDEO_FORMATS:
            raise ValueError(f"video_format must be one of {VIDEO_FORMATS}, got {self.video_format!r}")
        if not 0 < self.audio_s <= 600:
            raise ValueError(f"audio_s must be in (0, 600] seconds, got {self.audio_s}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"input_tokens and output_tokens must be >= 1, got "
                             f"{self.input_tokens}, {self.output_tokens}")
        bad = [m for m in self.mix if m not in MEDIA + ("text",)]
        if not self.mix or bad:
            raise ValueError(f"mix must name some of {MEDIA + ('text',)}, got {list(self.mix)}")


@dataclass(frozen=True)
class ChatRequest:
    """One request to send: `messages` in OpenAI chat form, and its label for metrics."""

    index: int
    modality: str
    messages: tuple[dict, ...] = field(repr=False)
    max_tokens: int = 32

    def body(self, model: str, ignore_eos: bool = False) -> dict:
        b: dict[str, Any] = {"model": model, "messages": list(self.messages), "max_tokens": self.max_tokens,
                             "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
        if ignore_eos:
            b["ignore_eos"] = True
        return b


def parse_size(text: str, what: str = "--image-size") -> tuple[int, int]:
    """'WxH' -> (W, H)."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{what} must be WIDTHxHEIGHT in pixels (e.g. 448x448), got {text!r}") from None
    return w, h


def modalities(spec: WorkloadSpec, n: int, seed: int = 0) -> list[str]:
    """The modality of each of the n requests `synthesize(spec, n, seed)` makes (no media built)."""
    rng = random.Random(seed)
    return [rng.choice(spec.mix) if spec.modality == "mixed" else spec.modality for _ in range(n)]


def synthesize(spec: WorkloadSpec, n: int, seed: int = 0, content_seed: int | None = None) -> list[ChatRequest]:
    """n requests of `spec`; request i's media and text are seeded by (content_seed, i), so each
    is unique; the modality mix by `seed` (content_seed None: `seed` too). A run that must not hit
    a server's caches with an earlier run's media, at the same arrivals, changes content_seed alone."""
    out, c = [], seed if content_seed is None else content_seed
    for i, kind in enumerate(modalities(spec, n, seed)):
        content = _media_parts(spec, kind, c * 1_000_003 + i)
        content.append({"type": "text", "text": text_of(spec.input_tokens, c * 1_000_003 + i)})
        out.append(ChatRequest(i, kind, ({"role": "user", "content": content},), spec.output_tokens))
    return out


def _media_parts(spec: WorkloadSpec, kind: str, seed: int) -> list[dict]:
    if kind == "image":
        return [{"type": "image_url", "image_url": {"url": _data_uri(png(*spec.image_size, seed), "image/png")}}]
    if kind == "video":
        frames = [_frame(*spec.video_size, seed, k) for k in range(spec.video_frames)]
        if spec.video_format == "frames":
            uris = [_data_uri(_png_of(f), "image/png") for f in frames]
            return [{"type": "video_url", "video_url": {"frames": uris}}]
        return [{"type": "video_url", "video_url": {"url": _data_uri(gif(frames), "image/gif")}}]
    if kind == "audio":
        return [{"type": "input_audio",
                 "input_audio": {"data": base64.b64encode(wav(spec.audio_s, seed)).decode(), "format": "wav"}}]
    return []


def text_of(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_tokens))


def _frame(w: int, h: int, seed: int, k: int = 0):
    """A seeded smooth RGB pattern (an 8x8 random grid upscaled), drifting with frame index k."""
    from PIL import Image
    grid = np.random.default_rng([seed, k]).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((w, h), Image.BILINEAR)


def _png_of(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def png(w: int, h: int, seed: int) -> bytes:
    return _png_of(_frame(w, h, seed))


def gif(frames: list) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


def wav(seconds: float, seed: int, rate: int = AUDIO_RATE) -> bytes:
    n = max(1, int(round(seconds * rate)))
    samples = (0.1 * np.random.default_rng(seed).standard_normal(n) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def _data_uri(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


# ---- dataset replay ------------------------------------------------------------------------
def load_dataset(path: str | Path, default_max_tokens: int = 32) -> list[ChatRequest]:
    """Requests from a JSONL file (format in the module docstring); ValueError names the line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the dataset {str(path)!r}: {e.strerror}") from None
    out: list[ChatRequest] = []
    for no, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(_dataset_request(line, f"{path}:{no}", len(out), default_max_tokens))
    if not out:
        raise ValueError(f"{path} holds no requests; write one JSON object per line")
    return out


def _dataset_request(line: str, where: str, index: int, default_max_tokens: int) -> ChatRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        msgs = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ValueError(f"{where}: give 'messages' (OpenAI chat messages) or 'prompt' (a non-empty string)")
    mt = obj.get("max_tokens", default_max_tokens)
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise ValueError(f"{where}: max_tokens must be an int >= 1, got {mt!r}")
    modality = obj.get("modality") or _guess_modality(msgs)
    if not isinstance(modality, str):
        raise ValueError(f"{where}: modality must be a string label, got {modality!r}")
    return ChatRequest(index, modality, tuple(msgs), mt)


def _guess_modality(messages: list[dict]) -> str:
    kinds = {_PART_MODALITY.get(p.get("type"), "text") for m in messages
             if isinstance(m.get("content"), list) for p in m["content"] if isinstance(p, dict)}
    media = sorted(kinds - {"text"})
    return media[0] if len(media) == 1 else ("mixed" if media else "text")
