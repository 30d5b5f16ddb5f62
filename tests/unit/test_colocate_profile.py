"""The start-up partition profile times finished GPU work: the clock starts after the
warm-up's stream has drained and stops after the timed runs' stream has drained."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS

import numpy as np

from easerve.control.sm_backends import SMBackend
from services.encode.colocate import measure_fn


class QueuedGpu:
    """Kernels are queued at launch (no time passes) and run when the stream is synchronized,
    advancing the clock by their duration: what an asynchronous device looks like to the host."""

    def __init__(self) -> None:
        self.now, self.pending = 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.now, self.pending = self.now + self.pending, 0.0


class SyncingBackend(SMBackend):
    """Levels 0.25 / 1.0; the encode scope's exit synchronizes its stream, as on CUDA."""

    def __init__(self, gpu: QueuedGpu) -> None:
        super().__init__((0.25, 1.0), "fake")
        self.gpu = gpu

    @contextlib.contextmanager
    def encode_context(self, level=None, sync=True):
        self.live = self.levels[level]
        yield
        self.gpu.sync()


class SlowerOnFewerSMs:
    modalities = ("audio",)

    def __init__(self, backend: SyncingBackend, per_item_s: float) -> None:
        self.backend, self.per_item_s = backend, per_item_s

    def preprocess(self, messages):
        assert isinstance(messages[0]["content"][0]["audio"], np.ndarray)
        return NS(items=["clip"])

    def encode(self, items) -> None:  # launches only: the work lands on the stream
        self.backend.gpu.pending += self.per_item_s * len(items) / self.backend.live


def test_profile_times_the_encode_work_of_each_share() -> None:
    gpu = QueuedGpu()
    backend = SyncingBackend(gpu)
    measure = measure_fn(SlowerOnFewerSMs(backend, 0.01), backend, repeats=2, clock=gpu.clock)
    assert abs(measure(4, 1.0) - 0.04) < 1e-12   # 4 items x 10 ms, warm-up excluded
    assert abs(measure(4, 0.25) - 0.16) < 1e-12  # a quarter of the SMs: 4x slower, and it shows
