"""The gateway's media decode pool (easerve.media.pool) with real worker processes: decodes
match the in-process decoders, one decode per content hash, images in a thread while one is idle, a full
queue is Overloaded, and a video file's kept frames come from seeking (only the GOPs holding
them are decoded)."""
from __future__ import annotations

import asyncio
import io
import os

import numpy as np
import pytest

from easerve.errors import MediaError, Overloaded
from easerve.media.pool import DecodePool
from easerve.media.shipping import Shipped
from easerve.media.video import VideoSampling, decode_video_file
from tests.support.media import mapped as _mapped, png_bytes
from tests.models.media_clips import decode_all_frames, smooth_frames

pytestmark = pytest.mark.slow  # starts worker processes


def h264(n: int, fps: int = 30, gop: int = 15, h: int = 64, w: int = 96) -> bytes:
    """An MP4 of `n` frames with a keyframe every `gop` frames."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps, options={"g": str(gop), "preset": "ultrafast", "crf": "20"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for arr in smooth_frames(n, h, w):
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


VIDEO_OPTS = (8192, 1024, 10**9, 108_000, 2.0, 4, 768, 1)


@pytest.fixture(scope="module")
def pool():
    p = DecodePool(workers=2, max_pending=2)
    p.start()
    assert p.decoder in ("NONE", "SLICE", "FRAME", "AUTO")
    yield p
    p.close()


def _run(coro):
    return asyncio.run(coro)


def test_video_decodes_only_the_gops_of_kept_frames():
    raw = h264(120, gop=15)  # 4 s at 30 fps; 2 fps keeps frames 0, 15, ..., 105: each a keyframe
    v = decode_video_file(raw, VideoSampling(fps=2.0))
    assert v.indices == list(range(0, 120, 15))
    assert v.decoded_frames == 8  # decode-all up to the last kept frame would be 106
    assert np.array_equal(v.frames, decode_all_frames(raw)[v.indices])
    mid = decode_video_file(h264(120, gop=40), VideoSampling(fps=2.0))  # kept frames inside GOPs
    assert np.array_equal(mid.frames, decode_all_frames(h264(120, gop=40))[mid.indices])
    assert mid.decoded_frames < 106


def test_worker_decodes_match_in_process_and_same_content_decodes_once(pool):
    raw = h264(60, gop=15)

    async def both():
        key = pool.key("video", raw, VIDEO_OPTS)
        return await asyncio.gather(pool.decode("video", raw, VIDEO_OPTS, key),
                                     pool.decode("video", raw, VIDEO_OPTS, key))

    before = pool.decodes
    (a, ran_a), (b, ran_b) = _run(both())
    assert pool.decodes - before == 1 and [ran_a, ran_b] == [True, False]
    ref = decode_video_file(raw, VideoSampling(fps=2.0))
    assert np.array_equal(a.array, ref.frames) and a.array is b.array and a.fps == ref.sampled_fps
    assert a.cpu_s > 0


def test_images_decode_in_a_thread_large_ones_in_a_worker_and_bad_bytes_are_a_media_error(pool):
    """Up to THREAD_IMAGE_PIXELS (1080p included) an image is decoded in a decode thread of the
    gateway (the hop to a worker costs the gateway more than a third of the decode); above, in a
    worker; both give the in-process pixels."""
    from PIL import Image

    from easerve.media.pool import THREAD_IMAGE_PIXELS
    opts = (8192, 10**9)
    small, hd, large = png_bytes(40, 30, seed=3), png_bytes(1920, 1080, seed=4), png_bytes(2050, 2050, seed=5)
    assert 1920 * 1080 <= THREAD_IMAGE_PIXELS < 2050 * 2050
    before = pool.in_thread
    for raw, pixels in ((small, 1200), (hd, 1920 * 1080)):
        d, _ = _run(pool.decode("image", raw, opts, pool.key("image", raw, opts)))
        assert np.array_equal(d.array, np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))) and d.pixels == pixels
        assert d.in_thread and d.cpu_s > 0
    assert pool.in_thread == before + 2
    d, _ = _run(pool.decode("image", large, opts, pool.key("image", large, opts)))
    assert np.array_equal(d.array, np.asarray(Image.open(io.BytesIO(large)).convert("RGB")))
    assert not d.in_thread and d.cpu_s > 0 and pool.in_thread == before + 2
    assert not _mapped(d.array)  # 12.6 MB of pixels: through the pipe, cheaper below SHIP_MIN_BYTES
    with pytest.raises(MediaError, match="could not be decoded"):
        _run(pool.decode("image", b"not an image", opts, pool.key("image", b"not an image", opts)))


def test_an_image_that_finds_every_decode_thread_busy_goes_to_a_worker_and_the_threads_yield_to_the_loop():
    """With one decode thread, of two images arriving together the first takes the thread and
    the second a worker (a burst spreads over the workers); the thread runs at the workers'
    niceness."""
    from PIL import Image

    from easerve.media.pool import WORKER_NICE
    p = DecodePool(workers=1, threads=1)
    p.start()
    try:
        opts = (8192, 10**9)
        a, b = png_bytes(640, 480, seed=6), png_bytes(640, 480, seed=7)

        async def both():
            return await asyncio.gather(p.decode("image", a, opts, p.key("image", a, opts)),
                                        p.decode("image", b, opts, p.key("image", b, opts)))
        (da, _), (db, _) = _run(both())
        assert [da.in_thread, db.in_thread] == [True, False] and p.in_thread == 1
        for d, raw in ((da, a), (db, b)):
            assert np.array_equal(d.array, np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")))
        d, _ = _run(p.decode("image", b, opts, b"another key"))  # the thread is idle again
        assert d.in_thread and p.in_thread == 2
        nice = p._thread_exec.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result()
        assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
    finally:
        p.close()


def test_a_shipped_answer_is_unlinked_on_arrival_even_when_nobody_awaits_it(pool):
    """The segment of a worker's answer is mapped and unlinked as soon as the answer arrives,
    before (or without) any await: a cancelled request leaves nothing in /dev/shm."""
    import concurrent.futures

    from easerve.media.pool import _decode_shipped, _received
    raw = h264(60, gop=15, h=720, w=1280)
    opts = (8192, 1024, 10**9, 108_000, 4.0, 8, 768, 1)  # 8 frames of 720p: 22 MB, past SHIP_MIN_BYTES
    answer = pool._exec.submit(_decode_shipped, "video", raw, opts)
    mapped = _received(answer)
    shipped = answer.result(timeout=60).array
    assert isinstance(shipped, Shipped)
    d = mapped.result(timeout=10)
    assert not os.path.exists(f"/dev/shm/{shipped.name}") and _mapped(d.array)
    assert d.array.shape == (8, 720, 1280, 3)
    assert np.array_equal(d.array, decode_video_file(raw, VideoSampling(fps=4.0, min_frames=8)).frames)
    cancelled = concurrent.futures.Future()
    follower = _received(cancelled)
    cancelled.cancel()
    assert follower.cancelled()


def test_a_full_queue_is_overloaded(pool):
    raws = [h264(60, gop=15, w=128 + 16 * i) for i in range(3)]  # three contents not decoded before; max_pending 2

    async def three():
        return await asyncio.gather(*(pool.decode("video", r, VIDEO_OPTS, pool.key("video", r, VIDEO_OPTS))
                                      for r in raws), return_exceptions=True)

    out = _run(three())
    assert [type(o).__name__ for o in out] == ["tuple", "tuple", "Overloaded"]
    assert isinstance(out[2], Overloaded) and "media decode queue is full (2 items" in str(out[2])
