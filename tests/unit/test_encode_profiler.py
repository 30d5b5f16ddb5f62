"""The one encode profiler: it times finished device work, measures every batch size x share of
the live backend, and the co-located encode worker's start-up writes what it measured as an
easerve.profile/v1 file (encode scope) that a restart, or a `hasctl profile` file, feeds back."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os

import pytest

from easerve.models.loader import load_adapter
from easerve.models.tiny import cached_tiny
from easerve.partition.backends import TimeSliceBackend
from easerve.partition.sm_backend import SMBackend
from easerve.policy.partitioner import DEFAULT_SHARES, LatencyGrid
from easerve.stages.encode import profiler
from easerve.stages.encode.colocate import build_controller
from easerve import profile_format as pf
from tests.support.profiles import make_profile


class QueuedGpu:
    """Kernels are queued at launch (no time passes) and run when the stream is synchronized,
    advancing the clock by their duration: what an asynchronous device looks like to the host."""

    def __init__(self) -> None:
        self.now, self.pending = 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.now, self.pending = self.now + self.pending, 0.0


class SyncingSplit(SMBackend):
    """A split backend (levels 0.25 / 1.0) whose encode scope's exit drains its stream, as on CUDA."""
    name = "green_contexts"

    def __init__(self, gpu: QueuedGpu) -> None:
        super().__init__((0.25, 1.0), "queued test device")
        self.gpu, self.live = gpu, 1.0

    @contextlib.contextmanager
    def encode_context(self, level=None, sync=True):
        self.live = self.levels[self.level if level is None else level]
        yield
        self.gpu.sync()


class LaunchOnly:
    """An encoder whose work lands on the queued device: slower on fewer SMs."""
    modalities = ("audio",)

    def __init__(self, backend: SyncingSplit, per_item_s: float) -> None:
        self.backend, self.per_item_s = backend, per_item_s

    def preprocess(self, messages):
        part = messages[0]["content"][0]
        assert part["type"] == "audio" and part["audio"].shape == (16000,)  # STARTUP_MEDIA: 1 s at 16 kHz

        class Prompt:
            items = ["clip"]
        return Prompt()

    def encode(self, items) -> None:
        self.backend.gpu.pending += self.per_item_s * len(items) / self.backend.live


def test_the_clock_is_read_after_the_encode_work_drained() -> None:
    gpu = QueuedGpu()
    backend = SyncingSplit(gpu)
    enc = profiler.measure_encode(LaunchOnly(backend, 0.01), backend, (4, 1), repeats=3, clock=gpu.clock)
    got = {(p.batch_size, p.share): p.latency_s for p in enc.grid}
    assert got == pytest.approx({(1, 0.25): 0.04, (1, 1.0): 0.01, (4, 0.25): 0.16, (4, 1.0): 0.04}, abs=1e-12)
    assert (enc.backend, enc.reference_modality, enc.reference_media) == ("green_contexts", "audio", "1s")


def test_a_backend_that_cannot_split_gets_share_one_only() -> None:
    gpu = QueuedGpu()
    split = SyncingSplit(gpu)
    enc = profiler.measure_encode(LaunchOnly(split, 0.01), TimeSliceBackend(), (1, 2), repeats=1,
                                  sync=gpu.sync, clock=gpu.clock)
    assert enc.backend == "none" and enc.shares == (1.0,) and "share 1.0 only" in enc.backend_note
    assert [p.latency_s for p in enc.grid] == pytest.approx([0.01, 0.02])


def test_synthetic_media_is_seeded_and_sized() -> None:
    a, b = profiler.synthetic_part("image", (64, 32), seed=3), profiler.synthetic_part("image", (64, 32), seed=3)
    assert a["image"].size == (64, 32) and a["image"].tobytes() == b["image"].tobytes()
    assert profiler.synthetic_part("video", (4, 56, 28))["video"].shape == (4, 28, 56, 3)
    with pytest.raises(ValueError, match="no synthetic media for modality 'text'"):
        profiler.synthetic_part("text")


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return str(cached_tiny("qwen2.5-vl", os.environ.get("EASERVE_TINY_CACHE") or tmp_path_factory.mktemp("tiny")))


def _start(adapter, model: str, path, backend: str = "cpu_affinity"):
    """The encode worker's partition start-up, on its own two worker threads."""
    with concurrent.futures.ThreadPoolExecutor(1) as enc, concurrent.futures.ThreadPoolExecutor(1) as pre:
        return build_controller(adapter, "cpu", backend, "dynamic", str(path), (1, 2), 0.1, enc, pre, model=model)


def test_startup_writes_a_profile_file_that_a_restart_and_hasctl_share(tiny_vl, tmp_path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the cpu_affinity split needs two allowed cores")
    path = tmp_path / "encode-0.encode-profile.json"
    ctl = _start(load_adapter(tiny_vl, role="encode"), tiny_vl, path)
    prof = pf.load(path, require="encode")
    assert json.loads(path.read_text())["format"] == "easerve.profile/v1" and prof.scope == "encode"
    assert prof.encode.backend == "cpu_affinity" and prof.encode.reference_media == "112x112"
    assert prof.model.family == "qwen2.5-vl" and prof.hardware.device == "cpu"
    assert {(p.batch_size, p.share) for p in prof.encode.grid} == {(b, s) for b in (1, 2) for s in DEFAULT_SHARES}
    grid = LatencyGrid.from_points((p.batch_size, p.share, p.latency_s) for p in prof.encode.grid)
    assert ctl.partitioner.grid == grid
    shown = json.loads(json.dumps(ctl.describe()))["latency_grid"]  # what /partition serves
    assert shown == {"batch_sizes": [1, 2], "shares": list(DEFAULT_SHARES), "latency_s": [list(r) for r in grid.latency_s]}
    # a restart loads it and measures nothing (no adapter to measure with)
    assert _start(None, tiny_vl, path).partitioner.grid == grid
    # a full profile from hasctl profile is taken as it is
    full = pf.dump(make_profile(), tmp_path / "full.json")
    assert _start(None, tiny_vl, full).partitioner.grid.shares == (0.5, 1.0)


def test_an_old_start_up_file_fails_saying_how_to_regenerate(tmp_path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the cpu_affinity split needs two allowed cores")
    old = tmp_path / "encode-0.sm-profile.json"
    old.write_text(json.dumps({"format": "easerve.sm_profile", "version": 1, "device": "", "batch_sizes": [1, 2],
                               "shares": list(DEFAULT_SHARES), "latency_s": [[0.1] * 5, [0.2] * 5]}))
    with pytest.raises(ValueError, match=r"sm-profile.json: this is an easerve.sm_profile file.*delete it"):
        _start(None, "unused", old)
