"""A steady client load on a live stack, from threads, counting sent / completed / failed."""
from __future__ import annotations

import threading
import time

from easerve import Client
from tests.support.media import png_bytes


class ClientLoad:
    """`workers` threads sending requests back to back (every 4th of worker 0 with an image),
    counting what was sent, what completed and each failure."""

    def __init__(self, target: str, workers: int = 3, max_tokens: int = 4, all_images: bool = False,
                 image_size: tuple[int, int] = (40, 48)):
        self.client, self.max_tokens, self.all_images = Client(target, timeout=120), max_tokens, all_images
        self.image_size = image_size
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = self.ok = self.images_ok = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]

    def __enter__(self) -> ClientLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)
        self.client.close()

    def _run(self, w: int) -> None:
        k = 0
        while not self.stop.is_set():
            image = self.all_images or (w == 0 and k % 4 == 3)
            kw = {"images": [png_bytes(*self.image_size, k)], "prompt": "What is this?"} if image else \
                {"prompt": f"Count to {k} please"}
            with self.lock:
                self.sent += 1
            try:
                out = self.client.generate(max_tokens=self.max_tokens, **kw)
                assert len(out.token_ids) >= 1, out
            except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                with self.lock:
                    self.errors.append(f"{'image' if image else 'text'} request {w}/{k}: {e!r}")
            else:
                with self.lock:
                    self.ok += 1
                    self.images_ok += image
            k += 1

    def wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert not self.errors, self.errors
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} (sent {self.sent}, ok {self.ok})")
            time.sleep(0.2)
