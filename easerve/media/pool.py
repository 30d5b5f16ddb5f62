"""Media decoding in a bounded pool of worker processes, once per content hash.

`DecodePool` decodes media files (images, video files, audio files) in `workers` processes
(forkserver: no state of the gateway is inherited), so that decoding neither blocks the
gateway's event loop nor holds its GIL. A worker receives only raw bytes and plain settings
(ints, floats, strings) and returns numpy arrays: nothing built from a request is pickled into
it. Items with the same content hash (`easerve.media.content_hash.media_hash` over the bytes and
the decode settings) share one decode while it runs and, after, a small LRU of recent results.
More than `max_pending` distinct decodes waiting or running: Overloaded (RESOURCE_EXHAUSTED / 429).

An image of at most THREAD_IMAGE_PIXELS (read from its header; a 1080p frame is 2.07 M) is
decoded in one of the gateway's `threads` decode threads instead, when one is idle: the hop to a
worker and back (pickling the bytes out and the pixels in, 6 MB for 1080p) costs the gateway's
process more CPU than a third of the decode itself, and Pillow lets go of the GIL while it decodes,
so the event loop keeps running. The threads run at the workers' niceness (the event loop comes
first on a busy host), and an image that finds them all busy goes to a worker, so a burst of images
spreads over the workers as before. Larger images, video and audio go to the workers. A worker's
large array comes back through shared memory, not the pipe (easerve/media/shipping.py).

At start the pool times FFmpeg's decoder threading modes on a probe clip in a worker and keeps
the fastest (`decoder`), which it logs.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import io
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from easerve.media.content_hash import media_hash
from easerve.media.shipping import receive, ship
from easerve.errors import Overloaded

log = logging.getLogger("easerve.media")
THREAD_TYPES = ("NONE", "SLICE", "FRAME", "AUTO")
_KEY_TAG = b"easerve.media.pool/v1"
WORKER_NICE = 10
THREAD_IMAGE_PIXELS = 1 << 22  # images up to this many pixels (2048 x 2048) decode in a gateway thread when one is idle


@dataclass(frozen=True)
class Decoded:
    """A decode's answer: the arrays, what they are, and the CPU seconds the decode took (of the
    worker process, or of the gateway's thread when `in_thread`)."""

    kind: str                   # image | video | audio
    array: np.ndarray           # image [H, W, 3]; video [T, H, W, 3] uint8; audio float32 [N]
    fps: float | None = None    # video: frames kept per second of video (None: not known)
    cpu_s: float = 0.0
    in_thread: bool = False     # decoded in a decode thread of this process (an image), not in a worker

    @property
    def pixels(self) -> int:
        a = self.array
        return 0 if self.kind == "audio" else int(np.prod(a.shape[:-1]))

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


# ---- in the worker ------------------------------------------------------------------------
_THREAD_TYPE = "AUTO"


def _hold(seconds: float) -> int:
    time.sleep(seconds)  # keeps this worker busy so that the next task starts another
    return os.getpid()


def _init_worker(thread_type: str) -> None:
    global _THREAD_TYPE
    _THREAD_TYPE = thread_type
    os.nice(WORKER_NICE)  # the gateway's event loop comes first on a busy host
    import av  # noqa: F401  (loaded once per worker, not per item)
    import PIL.Image  # noqa: F401


def _decode(kind: str, raw: bytes, opts: tuple) -> Decoded:
    """Decode one file (`raw` bytes; `opts` plain numbers and strings) in a worker process."""
    from easerve.media.audio import decode_audio
    from easerve.media.common import PixelBudget
    from easerve.media.image import decode_image
    from easerve.media.video import VideoSampling, decode_video, decode_video_file, is_video_file

    t0 = time.process_time()
    if kind == "image":
        max_side, pixels = opts
        out = Decoded("image", np.asarray(decode_image(raw, max_side, budget=PixelBudget(pixels))))
    elif kind == "video":
        max_side, max_frames, pixels, max_source, fps, min_f, max_f, multiple = opts
        budget = PixelBudget(pixels)
        if is_video_file(raw):
            v = decode_video_file(raw, VideoSampling(fps, min_f, max_f, multiple), max_side, max_frames, budget,
                                  max_source, thread_type=_THREAD_TYPE)
            out = Decoded("video", v.frames, v.sampled_fps)
        else:  # an animated GIF / WebP / PNG: every frame
            frames = decode_video(raw, max_side, max_frames, budget=budget)
            out = Decoded("video", np.stack([np.asarray(f) for f in frames]))
    elif kind == "audio":
        target_rate, max_seconds, why = opts
        out = Decoded("audio", decode_audio(raw, target_rate=target_rate, max_seconds=max_seconds, why=why))
    else:
        raise ValueError(f"unknown media kind {kind!r}")
    return Decoded(out.kind, out.array, out.fps, time.process_time() - t0)


def _decode_shipped(kind: str, raw: bytes, opts: tuple) -> Decoded:
    """`_decode` in a worker, its array shipped through shared memory when large (in transit its
    `array` is then a `shipping.Shipped`; `_received` turns it back); the copy counts in cpu_s."""
    d = _decode(kind, raw, opts)
    t0 = time.process_time()
    return Decoded(d.kind, ship(d.array), d.fps, d.cpu_s + time.process_time() - t0)


def _probe_clip() -> bytes:
    """A 2 s 640x360 H.264 clip (made here, with PyAV's encoder) to time the decoders on."""
    import av

    buf = io.BytesIO()
    y, x = np.mgrid[0:360, 0:640]
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("libx264", rate=30, options={"preset": "ultrafast", "g": "30"})
        s.width, s.height, s.pix_fmt = 640, 360, "yuv420p"
        for t in range(60):
            arr = np.stack([(x + 4 * t) % 256, (y + 2 * t) % 256, (x + y) % 256], -1).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _probe() -> tuple[str, dict[str, float]]:
    """(the fastest decoder threading mode, seconds per mode) decoding every frame of the probe clip."""
    import av

    clip, times = _probe_clip(), {}
    for mode in THREAD_TYPES:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            with av.open(io.BytesIO(clip)) as c:
                stream = c.streams.video[0]
                stream.thread_type = mode
                for f in c.decode(stream):
                    f.to_ndarray(format="rgb24")
            best = min(best, time.perf_counter() - t0)
        times[mode] = best
    return min(times, key=times.get), times


def gateway_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _lower_priority() -> None:
    """Run this thread at the workers' niceness (Linux: a thread has its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
    except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
        pass


def _decode_here(raw: bytes, opts: tuple) -> Decoded | None:
    """An image decoded in this thread when its header says at most THREAD_IMAGE_PIXELS (its CPU:
    this thread's), else None; bad bytes: the MediaError a worker's decode would raise."""
    from easerve.media.common import PixelBudget
    from easerve.media.image import decode_opened, open_image

    t0 = time.thread_time()
    max_side, pixels = opts
    im = open_image(raw, "image", max_side)  # the header only
    if im.size[0] * im.size[1] > THREAD_IMAGE_PIXELS:
        return None
    array = np.asarray(decode_opened(im, "image", PixelBudget(pixels)))
    return Decoded("image", array, None, time.thread_time() - t0, in_thread=True)


# ---- in the gateway -----------------------------------------------------------------------
def _received(answer: concurrent.futures.Future) -> concurrent.futures.Future:
    """A worker's answer with a shipped array mapped back, done as soon as the answer arrives
    (in the pool's thread), so that its segment is unlinked even if nobody awaits it any more."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        if f.cancelled():
            out.cancel()
            return
        try:
            d = f.result()
            out.set_result(dataclasses.replace(d, array=receive(d.array)))
        except BaseException as e:  # noqa: BLE001 - the worker's error (a MediaError) goes to the awaiting call
            out.set_exception(e)

    answer.add_done_callback(done)
    return out


class DecodePool:
    def __init__(self, workers: int = 0, max_pending: int = 0, cache_mb: float = 256.0, threads: int = 0):
        """`workers` 0: one per core given to the gateway; `max_pending` 0: 16 per worker, at least 64;
        `threads` (image decode threads in this process) 0: one per core given to the gateway."""
        self.workers = workers or gateway_cores()
        self.threads = threads or gateway_cores()
        self._idle_threads = self.threads
        self._thread_exec: concurrent.futures.ThreadPoolExecutor | None = None
        self.max_pending = max_pending or max(64, 16 * self.workers)
        self.cache_bytes = int(cache_mb * (1 << 20))
        self.decoder = "AUTO"
        self._exec: concurrent.futures.ProcessPoolExecutor | None = None
        self._running: dict[bytes, asyncio.Future] = {}
        self._done: collections.OrderedDict[bytes, Decoded] = collections.OrderedDict()
        self._done_bytes = 0
        self.decodes = 0  # decodes run (shared and cached answers not counted)
        self.in_thread = 0  # of those, images decoded in a thread of this process

    def start(self) -> None:
        """Start the workers, after timing the decoders in one (logged)."""
        ctx = multiprocessing.get_context("forkserver")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as probe:
            self.decoder, times = probe.submit(_probe).result()
        self._exec = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                                            initargs=(self.decoder,))
        self._thread_exec = concurrent.futures.ThreadPoolExecutor(self.threads, "media-decode",
                                                                  initializer=_lower_priority)
        # every worker now, while no task is busy: the executor would start one per submit while
        # none is idle, a fork-server round trip on the event loop under the first burst of media
        for f in [self._exec.submit(_hold, 0.2) for _ in range(self.workers)]:
            f.result()
        import av
        from PIL import Image, features
        log.info("media decode: %d worker processes; video: FFmpeg %s (PyAV %s) decoders, threading %s "
                 "(fastest on the probe clip: %s); images: Pillow %s (libjpeg-turbo %s)", self.workers,
                 av.library_versions.get("libavcodec"), av.__version__, self.decoder,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()), Image.__version__,
                 features.version("libjpeg_turbo") or "absent")

    def close(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=True, cancel_futures=True)
            self._exec = None
        if self._thread_exec is not None:
            self._thread_exec.shutdown(wait=True, cancel_futures=True)
            self._thread_exec = None

    def key(self, kind: str, raw: bytes, opts: tuple) -> bytes:
        """The content hash that decodes are shared under (call off the event loop: it reads every byte)."""
        return media_hash(_KEY_TAG, kind, raw, {"opts": list(opts)})

    async def decode(self, kind: str, raw: bytes, opts: tuple, key: bytes) -> tuple[Decoded, bool]:
        """(the decoded item, whether this call ran the decode: False when shared or cached).
        Raises MediaError for bad media, Overloaded when `max_pending` decodes are queued or running."""
        if (hit := self._done.get(key)) is not None:
            self._done.move_to_end(key)
            return hit, False
        if (fut := self._running.get(key)) is not None:
            return await asyncio.shield(fut), False
        if self._exec is None:
            raise RuntimeError("DecodePool.start() was not called")
        if len(self._running) >= self.max_pending:
            raise Overloaded(f"the gateway's media decode queue is full ({self.max_pending} items decoding or "
                             f"waiting on {self.workers} workers); retry later")
        fut = asyncio.ensure_future(self._run(kind, raw, opts))
        self._running[key] = fut
        self.decodes += 1
        try:
            out = await asyncio.shield(fut)
        finally:
            self._running.pop(key, None)
        self._remember(key, out)
        return out, True

    async def _run(self, kind: str, raw: bytes, opts: tuple) -> Decoded:
        """An image in an idle decode thread of this process (unless its header says it is too
        large), everything else in a worker."""
        if kind == "image" and self._idle_threads > 0:
            self._idle_threads -= 1
            try:
                out = await asyncio.wrap_future(self._thread_exec.submit(_decode_here, raw, opts))
            finally:
                self._idle_threads += 1
            if out is not None:
                self.in_thread += 1
                return out
        return await asyncio.wrap_future(_received(self._exec.submit(_decode_shipped, kind, raw, opts)))

    def _remember(self, key: bytes, out: Decoded) -> None:
        if out.nbytes > self.cache_bytes // 4:
            return
        self._done[key] = out
        self._done_bytes += out.nbytes
        while self._done_bytes > self.cache_bytes:
            _, old = self._done.popitem(last=False)
            self._done_bytes -= old.nbytes
