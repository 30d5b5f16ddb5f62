"""Encode latency by batch size x compute share: the one profiler behind `hasctl profile` and
the co-located encode worker's start-up, the synthetic media both of them (and the encode
warm-up) encode, and the environment a profile records. What it measures is written as an
`easerve.profile/v1` file (`easerve.profile_format`, documented in docs/profile-format.md).

Timing (`time_call`): one warm-up call, then `repeats` timed calls, the median kept. Each call
runs in its own scope (the partition backend's encode context, whose exit waits for the
encode stream's GPU work) and is followed by `sync` (the whole device on CUDA), and the clock
is read only after both: it starts with the previous work drained and stops with this call's
work done, never at a kernel launch.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from easerve import profile_format as pf

# the media of the start-up grid: image WxH, video frames x W x H, audio seconds
STARTUP_MEDIA: dict[str, Any] = {"image": (112, 112), "video": (4, 112, 112), "audio": 1.0}
SPLIT_BACKENDS = ("green_contexts", "cpu_affinity")  # the backends that can run a share < 1.0


def media_label(modality: str, size) -> str:
    if modality == "image":
        return f"{size[0]}x{size[1]}"
    if modality == "video":
        return f"{size[0]}x{size[1]}x{size[2]}"
    return f"{size:g}s"


def synthetic_part(modality: str, size=None, seed: int = 0) -> dict:
    """A chat content part of seeded random media (what the gateway hands the HF processor):
    image (W, H), video (frames, W, H), audio seconds at 16 kHz; `size` None = STARTUP_MEDIA."""
    import numpy as np
    if modality not in STARTUP_MEDIA:
        raise ValueError(f"no synthetic media for modality {modality!r}; choose one of {sorted(STARTUP_MEDIA)}")
    size = STARTUP_MEDIA[modality] if size is None else size
    rng = np.random.default_rng(seed)
    if modality == "image":
        from PIL import Image
        return {"type": "image", "image": Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))}
    if modality == "video":
        f, w, h = size
        return {"type": "video", "video": rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8)}
    return {"type": "audio", "audio": (0.1 * rng.standard_normal(int(16000 * size))).astype(np.float32)}


def synthetic_item(adapter, modality: str | None = None, size=None, seed: int = 0):
    """One preprocessed media item of `modality` (default: the model's first) and `size`."""
    part = synthetic_part(modality or adapter.modalities[0], size, seed)
    return adapter.preprocess([{"role": "user", "content": [part, {"type": "text", "text": "x"}]}]).items[0]


def device_sync(device: str) -> Callable[[], None]:
    """What waits for `device`'s queued work: torch.cuda.synchronize on CUDA, nothing on CPU."""
    if not device.startswith("cuda"):
        return lambda: None
    import torch
    return lambda: torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], repeats: int, scope: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
              sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of `repeats` calls of `fn` after one warm-up (see the module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    def once() -> None:
        with scope():
            fn()
        sync()

    once()
    times = []
    for _ in range(repeats):
        t0 = clock()
        once()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_encode(adapter, backend, batch_sizes: Sequence[int], *, media=None, repeats: int = 2,
                   sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter,
                   tick: Callable[[str], None] = lambda _s: None) -> pf.EncodeProfile:
    """`adapter.encode` of b items of the model's first modality (size `media`, default
    STARTUP_MEDIA) for every batch size b x every level of `backend`. A backend that cannot
    split (MPS, time slicing) gets share 1.0 only, and the profile's backend reads "none"."""
    modality = adapter.modalities[0]
    size = STARTUP_MEDIA[modality] if media is None else media
    split = backend.name in SPLIT_BACKENDS
    item = synthetic_item(adapter, modality, size)
    grid = []
    for b in sorted(set(batch_sizes)):
        for share in (backend.levels if split else (1.0,)):
            level = backend.level_for(share) if split else None
            lat = time_call(lambda: adapter.encode([item] * b), repeats, lambda: backend.encode_context(level),
                            sync, clock)
            grid.append(pf.EncodePoint(b, float(share), lat))
            tick(f"encode b={b} share={share:g}")
    note = backend.reason if split else f"no partition backend here ({backend.reason}): share 1.0 only"
    return pf.EncodeProfile(backend.name if split else "none", note, modality, media_label(modality, size),
                            tuple(grid))


def startup_profile(adapter, backend, model: str, device: str, batch_sizes: Sequence[int],
                    repeats: int = 2) -> pf.Profile:
    """What a co-located encode worker measures at start: the encode grid alone (scope
    "encode") on its live backend, on the thread it will encode on."""
    encode = measure_encode(adapter, backend, batch_sizes, repeats=repeats, sync=device_sync(device))
    return pf.Profile(hardware(device, (device,)), versions(), model_info(model, tuple(adapter.modalities)), encode,
                      created_utc=utc_now(), scope="encode")


# ---- environment ----------------------------------------------------------------------------
def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def hardware(device: str, devices: tuple[str, ...]) -> pf.Hardware:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus: tuple[str, ...] = ()
    if device.startswith("cuda"):
        import torch
        gpus = tuple(torch.cuda.get_device_name(d) for d in devices)
    return pf.Hardware(cpu, len(os.sched_getaffinity(0)), gpus, device, devices)


def versions() -> pf.Versions:
    import importlib.metadata as md

    import torch
    import transformers
    try:
        ours = md.version("easerve")
    except md.PackageNotFoundError:
        ours = "unknown (not installed)"
    return pf.Versions(ours, torch.__version__, transformers.__version__, platform.python_version())


def model_info(path: str, modalities: tuple[str, ...]) -> pf.ModelInfo:
    from easerve.models.registry import detect_family
    digest = hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()
    return pf.ModelInfo(str(Path(path).resolve()), detect_family(path), digest, modalities)
