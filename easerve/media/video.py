"""Videos: frame lists, [T, H, W, C] arrays, animated GIF / WebP / PNG (PIL, every frame kept)
and video files (MP4 / MOV / WebM / MKV / AVI: H.264, VP9, AV1, ... through PyAV's FFmpeg).

A video file is sampled the way Qwen2.5-VL's processor samples (`VideoSampling`): `fps`
frames per second of video, at least `min_frames` and at most `max_frames`, rounded down to
a multiple of the temporal patch, spread uniformly over the clip. Frames are counted first
(demuxing only) and the kept frames' pixels are charged to the request's `PixelBudget`
before anything is decoded.
"""
from __future__ import annotations

import bisect
import io
from dataclasses import dataclass

import numpy as np

from easerve.media.common import PixelBudget, check_size, to_bytes
from easerve.errors import MediaError
from easerve.media.image import decode_image, open_image, to_rgb

VIDEO_ACCEPTS = ("an MP4 / MOV / WebM / MKV file (H.264, VP9, AV1, ...), an animated GIF / WebP / PNG, "
                 "a list of frames (image bytes / base64 / data: URIs) or an array [T, H, W, 3] of uint8")
_IMAGE_MAGIC = (b"GIF87a", b"GIF89a", b"\x89PNG\r\n\x1a\n")


@dataclass(frozen=True)
class VideoSampling:
    """How a video file's frames are chosen (Qwen2.5-VL: 2 fps, 4..768 frames, multiples of 2)."""

    fps: float | None = 2.0   # frames per second of video to keep; None: every frame (up to max_frames)
    min_frames: int = 4
    max_frames: int = 768
    frame_multiple: int = 1   # the temporal patch size: kept counts are rounded down to a multiple

    def __post_init__(self) -> None:
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"VideoSampling.fps must be > 0 (or None for every frame), got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"VideoSampling needs 1 <= min_frames <= max_frames, got {self.min_frames}, "
                             f"{self.max_frames}")
        if self.frame_multiple < 1:
            raise ValueError(f"VideoSampling.frame_multiple must be >= 1, got {self.frame_multiple}")

    @classmethod
    def from_processor(cls, processor, default_fps: float = 2.0) -> VideoSampling:
        """The sampling a HF processor's video processor asks for (its fps, or `default_fps`)."""
        vp = getattr(processor, "video_processor", None)
        if vp is None:
            return cls(fps=default_fps)
        fps = getattr(vp, "fps", None) or default_fps
        return cls(fps=float(fps), min_frames=int(getattr(vp, "min_frames", None) or 1),
                   max_frames=int(getattr(vp, "max_frames", None) or 768),
                   frame_multiple=int(getattr(vp, "temporal_patch_size", None) or 1))

    def indices(self, total: int, source_fps: float) -> list[int]:
        """Indices of the frames to keep out of `total` frames at `source_fps`."""
        if total < 1:
            return []
        want = total / source_fps * self.fps if self.fps is not None else total
        n = min(max(want, self.min_frames), self.max_frames, total)
        n = max(int(n // self.frame_multiple) * self.frame_multiple, min(total, self.frame_multiple))
        return sorted({int(k * total / n) for k in range(int(n))})


@dataclass
class DecodedVideo:
    frames: np.ndarray      # [T, H, W, 3] uint8 RGB
    indices: list[int]      # which source frames they are
    source_fps: float
    source_frames: int
    decoded_frames: int = 0  # frames the decoder produced to get them (kept ones included)

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of video (what the processor's `second_per_grid_ts` assumes)."""
        return len(self.indices) / self.source_frames * self.source_fps


def check_frames(n: int, max_frames: int) -> None:
    if n == 0:
        raise MediaError(f"video has 0 frames; send {VIDEO_ACCEPTS}")
    if n > max_frames:
        raise MediaError(f"video has {n} frames; at most {max_frames} are accepted: sample fewer frames")


def _array_video(arr: np.ndarray, max_side: int, max_frames: int, budget: PixelBudget | None) -> np.ndarray:
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3, 4):
        raise MediaError(f"video array has shape {arr.shape}; expected [T, H, W, 3] (uint8 RGB)")
    check_frames(arr.shape[0], max_frames)
    check_size(arr.shape[2], arr.shape[1], "video frame", max_side)
    if budget is not None:
        budget.take(arr.shape[0] * arr.shape[1] * arr.shape[2], f"video array {arr.shape[:3]}")
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.number) or not np.isfinite(arr).all():
            raise MediaError(f"video array has dtype {arr.dtype} or non-finite values; send uint8 RGB")
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return np.ascontiguousarray(arr[..., :3])


def _animated_image(raw: bytes, max_side: int, max_frames: int, budget: PixelBudget | None) -> list:
    from PIL import ImageSequence

    im = open_image(raw, "video", max_side)
    n = getattr(im, "n_frames", 1)
    check_frames(n, max_frames)
    if budget is not None:  # counted from the header: nothing is expanded yet
        budget.take(n * im.size[0] * im.size[1], f"animated image ({n} frames of {im.size[0]}x{im.size[1]})")
    return [to_rgb(f.copy(), "video frame") for f in ImageSequence.Iterator(im)]


def _is_animated_image(raw: bytes) -> bool:
    return raw.startswith(_IMAGE_MAGIC) or (raw[:4] == b"RIFF" and raw[8:12] == b"WEBP")


def is_video_file(raw: bytes) -> bool:
    """True when `raw` is a container file for PyAV rather than an animated GIF / WebP / PNG."""
    return not _is_animated_image(raw)


def decode_video(data, max_side: int = 8192, max_frames: int = 1024, budget: PixelBudget | None = None,
                 sampling: VideoSampling | None = None, max_source_frames: int = 108_000):
    """Frames list / GIF / WebP -> list[PIL.Image]; array [T,H,W,C] or a video file -> uint8 array.

    Video files are sampled by `sampling` (default `VideoSampling()`)."""
    if isinstance(data, np.ndarray):
        return _array_video(data, max_side, max_frames, budget)
    if isinstance(data, (list, tuple)):
        check_frames(len(data), max_frames)
        return [decode_image(f, max_side, what=f"video frame {i}", budget=budget) for i, f in enumerate(data)]
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        raw = to_bytes(data, "video")
        if not is_video_file(raw):
            return _animated_image(raw, max_side, max_frames, budget)
        return decode_video_file(raw, sampling or VideoSampling(), max_side=max_side, max_frames=max_frames,
                                 budget=budget, max_source_frames=max_source_frames).frames
    raise MediaError(f"video of type {type(data).__name__} is not accepted; send {VIDEO_ACCEPTS}")


# ---- video files (PyAV) ----------------------------------------------------------------
def _open_container(raw: bytes):
    import av

    try:
        container = av.open(io.BytesIO(raw), mode="r")
    except (av.FFmpegError, ValueError) as e:
        raise MediaError(f"video could not be decoded ({type(e).__name__}: {e}); send {VIDEO_ACCEPTS}") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"the file has no video stream; send {VIDEO_ACCEPTS}")
    return container


@dataclass(frozen=True)
class _Index:
    """A video stream's frames from its packets alone: how many, at what rate, the
    presentation timestamps in display order and which frames (display indices) are keyframes."""

    frames: int
    fps: float
    pts: list[int] | None        # sorted; None when some packet has none (then no seeking)
    keyframes: list[int]


def _count_frames(raw: bytes) -> _Index:
    """The stream's `_Index` from the packets alone (one frame per packet), no decoding."""
    import av

    with _open_container(raw) as c:
        stream = c.streams.video[0]
        pts, keys, n, no_pts = [], [], 0, False
        try:
            for packet in c.demux(stream):
                if packet.size:
                    n += 1
                    if packet.pts is None:
                        no_pts = True
                    else:
                        pts.append(packet.pts)
                        if packet.is_keyframe:
                            keys.append(packet.pts)
        except av.FFmpegError as e:
            raise MediaError(f"video file is corrupt ({e}); send a complete file") from None
        pts.sort()
        ordered = None if no_pts or len(set(pts)) != n else pts
        rank = {p: i for i, p in enumerate(pts)}
        keyframes = sorted(rank[p] for p in keys) if ordered else []
        rate = stream.average_rate or stream.guessed_rate
        if rate:
            return _Index(n, float(rate), ordered, keyframes)
        if len(pts) > 1 and stream.time_base:
            span = (max(pts) - min(pts)) * float(stream.time_base)
            if span > 0:
                return _Index(n, (len(pts) - 1) / span, ordered, keyframes)
        raise MediaError("the video file states no frame rate and its timestamps give none; "
                         "re-encode it, or send the frames as a list")


def _decode_all_until(c, stream, keep: list[int]) -> tuple[list[np.ndarray], int]:
    """(the kept frames, frames decoded) decoding every frame up to the last kept one (no
    timestamps to seek by)."""
    wanted, frames, n = set(keep), [], 0
    for i, frame in enumerate(c.decode(stream)):
        n += 1
        if i in wanted:
            frames.append(frame.to_ndarray(format="rgb24"))
        if i >= keep[-1]:
            break
    return frames, n


def _decode_seeking(c, stream, keep: list[int], index: _Index) -> tuple[list[np.ndarray], int]:
    """The kept frames, seeking to the keyframe before a kept frame whenever that skips frames
    not yet decoded: only the GOPs holding kept frames are decoded, each up to its last kept frame."""
    pts, keys = index.pts, index.keyframes
    rank = {p: i for i, p in enumerate(pts)}
    wanted, got, pos, frames_it, n = set(keep), {}, -1, None, 0
    for k in keep:
        if k in got:
            continue
        j = bisect.bisect_right(keys, k) - 1
        key = keys[j] if j >= 0 else 0
        if frames_it is None or key > pos + 1:
            if key > 0:
                c.seek(pts[key], stream=stream, backward=True, any_frame=False)
            frames_it = c.decode(stream)
        for frame in frames_it:
            n += 1
            i = rank.get(frame.pts)
            if i is None:
                continue
            pos = max(pos, i)
            if i in wanted and i not in got:
                got[i] = frame.to_ndarray(format="rgb24")
            if i >= k:
                break
    return [got[i] for i in keep if i in got], n


def decode_video_file(raw: bytes, sampling: VideoSampling, max_side: int = 8192, max_frames: int = 1024,
                      budget: PixelBudget | None = None, max_source_frames: int = 108_000,
                      thread_type: str = "AUTO") -> DecodedVideo:
    """A container file -> the frames `sampling` keeps, as RGB uint8 [T, H, W, 3]; only the
    GOPs holding kept frames are decoded (seeking by keyframe). `thread_type`: FFmpeg's decoder
    threading (AUTO, FRAME, SLICE or NONE; the media pool picks the fastest at start)."""
    import av

    index = _count_frames(raw)
    total, fps = index.frames, index.fps
    if total == 0:
        raise MediaError(f"video has 0 frames; send {VIDEO_ACCEPTS}")
    if total > max_source_frames:
        raise MediaError(f"video file holds {total} frames; at most {max_source_frames} are decoded: "
                         "send a shorter clip")
    keep = sampling.indices(total, fps)
    check_frames(len(keep), max_frames)
    with _open_container(raw) as c:
        stream = c.streams.video[0]
        stream.thread_type = thread_type
        w, h = stream.codec_context.width, stream.codec_context.height
        check_size(w, h, "video frame", max_side)
        if budget is not None:
            budget.take(len(keep) * w * h, f"video ({len(keep)} sampled frames of {w}x{h})")
        try:
            frames, n = _decode_seeking(c, stream, keep, index) if index.pts else _decode_all_until(c, stream, keep)
        except av.FFmpegError as e:
            raise MediaError(f"video file could not be decoded ({e}); send a complete, supported file") from None
    if not frames:
        raise MediaError(f"no frame of the video could be decoded; send {VIDEO_ACCEPTS}")
    if len(frames) < len(keep):  # fewer decoded frames than packets: repeat the last one
        frames += [frames[-1]] * (len(keep) - len(frames))
    shapes = {f.shape for f in frames}
    if len(shapes) != 1:
        raise MediaError(f"video frames change size mid-stream ({sorted(shapes)}); re-encode at one size")
    return DecodedVideo(np.stack(frames), keep, fps, total, n)

