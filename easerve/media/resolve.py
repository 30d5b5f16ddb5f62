"""From what a request names (`MediaRef`) to what the HF processor takes, off the event loop.

The API fronts turn content parts into `MediaPart`s holding `MediaRef`s (pure parsing);
`MediaResolver.resolve` then fetches the URLs among them concurrently (async, `MediaFetcher`) and
decodes them, charging one `PixelBudget` per request: files (image, video, audio bytes) in the
`DecodePool`'s worker processes when the resolver has one (once per content hash), the rest
(frame lists, arrays, or every item without a pool) in a worker thread. `fetch` alone
fetches without decoding (the gateway hashes media as received, and may then need no decoding at
all). Both return new parts; the ones given are left as they are.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from easerve.media.audio import decode_audio
from easerve.media.common import MediaLimits, PixelBudget, is_url, to_bytes
from easerve.errors import MediaError
from easerve.media.fetch import FetchConfig, MediaFetcher
from easerve.media.image import decode_image
from easerve.media.pool import DecodePool
from easerve.stages.common.host_time import cpu_timed
from easerve.media.video import VideoSampling, decode_video, decode_video_file, is_video_file
from easerve.types import ChatMessage, MediaPart, MediaRef, media_parts, with_media

__all__ = ["MediaConfig", "MediaRef", "MediaResolver", "config_for"]


@dataclass(frozen=True)
class MediaConfig:
    """What the gateway's model takes, and the limits it decodes under."""

    limits: MediaLimits = field(default_factory=MediaLimits)
    sampling: VideoSampling = field(default_factory=VideoSampling)
    audio_rate: int | None = None             # None: the model takes no audio
    audio_max_seconds: float | None = None    # the encoder's window when clips must fit in it
    audio_window_note: str = ""               # why, for the error message

    def __post_init__(self) -> None:
        if self.audio_max_seconds is not None and not self.audio_max_seconds > 0:
            raise ValueError(f"audio_max_seconds must be > 0, got {self.audio_max_seconds}")


class MediaResolver:
    def __init__(self, cfg: MediaConfig, fetcher: MediaFetcher | None = None, pool: DecodePool | None = None):
        self.cfg = cfg
        self.fetcher = fetcher or MediaFetcher(FetchConfig())
        self.pool = pool  # started by its owner

    async def resolve(self, parts: list[MediaPart], on_cpu: Callable[[float], None] | None = None) -> list[MediaPart]:
        """`parts` with every undecoded one decoded (a new part; a video's also says the rate
        of its frames when known). Raises MediaError (a ValueError) naming what to change.
        `on_cpu(seconds)` is told the CPU time spent decoding for this request (threads and workers)."""
        todo = [i for i, p in enumerate(parts) if not p.decoded]
        out = list(parts)
        if not todo:
            return out
        on_cpu = on_cpu or (lambda s: None)
        refs = [p.ref for p in await self.fetch([parts[i] for i in todo], on_cpu)]
        if self.pool is None:
            decoded = await asyncio.to_thread(cpu_timed(self.decode_all, on_cpu), refs)
        else:
            budget = PixelBudget(self.cfg.limits.max_request_pixels)
            decoded = await asyncio.gather(*(self._decode_one(r, budget, on_cpu) for r in refs))
        for i, part in zip(todo, decoded):
            out[i] = part
        return out

    async def _decode_one(self, ref: MediaRef, budget: PixelBudget, on_cpu: Callable[[float], None]) -> MediaPart:
        """One item: a file in the pool (its pixels charged to `budget` after), the rest in a thread."""
        if not isinstance(ref.source, (bytes, bytearray, memoryview, str)):
            return await asyncio.to_thread(cpu_timed(self.decode, on_cpu), ref, budget)
        kind, opts = ref.kind, self._pool_opts(ref)
        raw, key = await asyncio.to_thread(cpu_timed(self._keyed, on_cpu), ref, opts)
        d, ran = await self.pool.decode(kind, raw, opts, key)
        if ran:
            on_cpu(d.cpu_s)
        if d.pixels:
            budget.take(d.pixels, f"{kind} ({'x'.join(map(str, d.array.shape[:-1]))} pixels)")
        if kind == "image":
            from PIL import Image
            return MediaPart("image", ref, Image.fromarray(d.array))
        if kind == "video":
            return MediaPart("video", ref, d.array, d.fps if d.fps is not None else (float(ref.fps) if ref.fps else None))
        return MediaPart("audio", ref, d.array)

    def _keyed(self, ref: MediaRef, opts: tuple) -> tuple[bytes, bytes]:
        raw = to_bytes(ref.source, ref.kind)
        return raw, self.pool.key(ref.kind, raw, opts)

    def _pool_opts(self, ref: MediaRef) -> tuple:
        """The plain settings a worker decodes `ref` with (no object of the request's)."""
        lim, s = self.cfg.limits, self.cfg.sampling
        if ref.kind == "image":
            return (lim.max_side, lim.max_request_pixels)
        if ref.kind == "video":
            return (lim.max_side, lim.max_frames, lim.max_request_pixels, lim.max_source_frames,
                    float(ref.fps) if ref.fps else s.fps, s.min_frames, s.max_frames, s.frame_multiple)
        self._check_audio()
        max_s, why = self._audio_window()
        return (int(self.cfg.audio_rate), float(max_s), why)

    async def resolve_messages(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        return with_media(messages, await self.resolve(media_parts(messages)))

    async def fetch(self, parts: list[MediaPart], on_cpu: Callable[[float], None] | None = None) -> list[MediaPart]:
        """`parts` with the URLs among their refs fetched concurrently and every inline payload
        (base64 or a data: URI, one file or a frame list) decoded to bytes, once, in a worker
        thread (`on_cpu` is told its CPU time): each such source becomes bytes (what the encoder
        cache hashes and the decode pool takes), nothing is decoded as media. Resolving the
        parts returned fetches and converts nothing more. MediaError for bad base64."""
        refs = await asyncio.gather(*(self._fetch_ref(p.ref) for p in parts if not p.decoded))
        if any(_inline(r.source) for r in refs):
            refs = await asyncio.to_thread(cpu_timed(_inline_to_bytes, on_cpu or (lambda s: None)), refs)
        it = iter(refs)
        return [p if p.decoded else replace(p, ref=next(it)) for p in parts]

    async def _fetch_ref(self, ref: MediaRef) -> MediaRef:
        if is_url(ref.source):
            return replace(ref, source=await self.fetcher.fetch(ref.source))
        if isinstance(ref.source, list) and any(is_url(f) for f in ref.source):
            return replace(ref, source=list(await asyncio.gather(
                *(self.fetcher.fetch(f) if is_url(f) else _same(f) for f in ref.source))))
        return ref

    def decode_all(self, refs: list[MediaRef]) -> list[MediaPart]:
        """Decode already-fetched refs with one request budget (call from a worker thread)."""
        budget = PixelBudget(self.cfg.limits.max_request_pixels)
        return [self.decode(r, budget) for r in refs]

    def decode(self, ref: MediaRef, budget: PixelBudget) -> MediaPart:
        lim = self.cfg.limits
        if ref.kind == "image":
            return MediaPart("image", ref, decode_image(ref.source, lim.max_side, budget=budget))
        if ref.kind == "video":
            return self._video(ref, budget)
        return MediaPart("audio", ref, self._audio(ref))

    def _video(self, ref: MediaRef, budget: PixelBudget) -> MediaPart:
        lim, s = self.cfg.limits, self.cfg.sampling
        src = ref.source
        if isinstance(src, (bytes, bytearray, memoryview, str)):
            src = to_bytes(src, "video")
            if is_video_file(src):
                sampling = VideoSampling(ref.fps, s.min_frames, s.max_frames, s.frame_multiple) if ref.fps else s
                v = decode_video_file(src, sampling, lim.max_side, lim.max_frames, budget, lim.max_source_frames)
                return MediaPart("video", ref, v.frames, v.sampled_fps)
        frames = decode_video(src, lim.max_side, lim.max_frames, budget=budget)
        return MediaPart("video", ref, frames, float(ref.fps) if ref.fps else None)

    def _check_audio(self) -> None:
        if self.cfg.audio_rate is None:
            raise MediaError("this model does not take audio; remove the audio part")

    def _audio_window(self) -> tuple[float, str]:
        """(the longest clip accepted, seconds; why, for the error message)."""
        lim = self.cfg.limits
        max_s = min(lim.max_audio_seconds, self.cfg.audio_max_seconds or lim.max_audio_seconds)
        return max_s, self.cfg.audio_window_note if max_s < lim.max_audio_seconds else ""

    def _audio(self, ref: MediaRef):
        self._check_audio()
        max_s, why = self._audio_window()
        return decode_audio(ref.source, sample_rate=ref.sample_rate, target_rate=self.cfg.audio_rate,
                            max_seconds=max_s, why=why)


def _inline(source) -> bool:
    return isinstance(source, str) or (isinstance(source, list) and any(isinstance(f, str) for f in source))


def _inline_to_bytes(refs: list[MediaRef]) -> list[MediaRef]:
    """Every inline (string) source among `refs` as its bytes (call from a worker thread)."""
    def raw(v, what):
        return to_bytes(v, what) if isinstance(v, str) else v
    return [replace(r, source=[raw(f, f"{r.kind} frame") for f in r.source] if isinstance(r.source, list)
                    else raw(r.source, r.kind)) if _inline(r.source) else r for r in refs]


async def _same(x):
    return x


# Families whose processor pads or *truncates* every clip to the encoder window (Ultravox's splits it).
WINDOWED_AUDIO = ("qwen2-audio",)


def config_for(adapter, limits: MediaLimits | None = None) -> MediaConfig:
    """The media config a gateway serving `adapter` needs: its video sampling, audio rate, and for
    windowed audio encoders the window (a longer clip would be cut by the processor, so it is refused)."""
    limits = limits or MediaLimits()
    rate = adapter.sampling_rate
    window, note = None, ""
    fe = getattr(adapter.processor, "feature_extractor", None)
    if rate is not None and adapter.family in WINDOWED_AUDIO and fe is not None:
        window = float(fe.n_samples) / float(fe.sampling_rate)
        note = f" (the {adapter.family} audio encoder's window)"
    sampling = VideoSampling.from_processor(adapter.processor) if "video" in adapter.modalities else VideoSampling()
    return MediaConfig(limits=limits, sampling=sampling, audio_rate=rate, audio_max_seconds=window,
                       audio_window_note=note)
