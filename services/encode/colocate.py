"""Co-located prefill and the SM partition it runs under.

At start-up the encode worker profiles its encode latency over batch sizes x share
levels on the live backend (or loads a saved profile, so a restart reuses it), and
the partitioner keeps, per batch size, the smallest share within tolerance of the
exclusive latency. Each micro-batch then runs under its share; the co-located prefill
runs concurrently, on its own thread, under the rest.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

import numpy as np

from easerve.control.partitioner import (
    FixedPartitioner, PartitionerConfig, ProfileTable, SMPartitioner, policy_levels, profile)
from easerve.control.sm_backends import PartitionController, select_backend

log = logging.getLogger("easerve.encode")


def sample_items(adapter, n: int):
    """n synthetic media items of the model's first modality, for profiling."""
    rng = np.random.default_rng(0)
    kind = adapter.modalities[0]
    if kind == "audio":
        part = {"type": "audio", "audio": (0.1 * rng.standard_normal(16000)).astype(np.float32)}
    elif kind == "video":
        part = {"type": "video", "video": rng.integers(0, 255, (4, 112, 112, 3), dtype=np.uint8)}
    else:
        from PIL import Image
        part = {"type": "image", "image": Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))}
    item = adapter.preprocess([{"role": "user", "content": [part, {"type": "text", "text": "x"}]}]).items[0]
    return [item] * n


def measure_fn(adapter, backend, repeats: int = 2, clock=time.perf_counter):
    """measure(batch_size, share) -> seconds per encode under that share's level. The warm-up
    and the timed runs are separate scopes: each scope's exit waits for its stream's GPU work,
    so the clock starts with the warm-up's kernels done and stops with the timed ones done
    (reading it inside a scope would time only the kernel launches)."""
    def measure(batch_size: int, share: float) -> float:
        items = sample_items(adapter, batch_size)
        level = backend.level_for(share)
        with backend.encode_context(level):
            adapter.encode(items)  # warm
        t0 = clock()
        with backend.encode_context(level):
            for _ in range(repeats):
                adapter.encode(items)
        return (clock() - t0) / repeats
    return measure


def build_controller(adapter, device: str, backend_pref: str, policy: str, profile_path: str | None,
                     batch_sizes: tuple[int, ...], tolerance: float,
                     encode_pool: concurrent.futures.Executor,
                     prefill_pool: concurrent.futures.Executor) -> PartitionController:
    """Pick the backend for the policy's levels, pin the two worker threads, then (dynamic
    policy on a backend that can switch) profile encode on the encode thread itself, so the
    measured shares are the ones it will run under. A backend that cannot be had raises
    BackendUnavailable (start fails); "auto" that found none time-slices, logged as degraded."""
    config = PartitionerConfig(policy=policy, tolerance=tolerance)
    if policy == "timeslice" and backend_pref == "auto":
        backend_pref = "timeslice"  # the uncontrolled baseline: no mechanism wanted
    backend = select_backend(backend_pref, device, policy_levels(config), exact=policy == "static")
    log.info("SM backend %s: %s", backend.name, backend.reason)
    if backend.degraded:
        log.warning("SM partition degraded: %s", backend.degraded)
    bind = getattr(backend, "bind", None)
    if bind is not None:
        encode_pool.submit(bind, "encode").result()
        prefill_pool.submit(bind, "prefill").result()
    part, note = _partitioner(adapter, backend, config, profile_path, batch_sizes, encode_pool)
    if note:
        log.warning("%s", note)
    if part.policy == "static":
        r = backend.realized(0)
        log.info("static split: encode %.3f, prefill %.3f of the device", r.encode_share, r.prefill_share)
    return PartitionController(part, backend, note)


def _partitioner(adapter, backend, config: PartitionerConfig, profile_path, batch_sizes, encode_pool):
    """(partitioner, note): a backend fixed at launch gets a FixedPartitioner; `note` says
    when the policy asked for has nothing to choose there."""
    if not backend.dynamic:
        policy = {"static": "static", "timeslice": "timeslice"}.get(backend.name, "fixed")
        note = "" if config.policy == policy else (
            f"--partition-policy {config.policy} has nothing to choose on the {backend.name} backend: its "
            f"split is fixed at launch (encode {backend.realized(0).encode_share:g}); it runs as {policy}")
        return FixedPartitioner(backend.realized(0), policy, note), note
    if config.policy != "dynamic":
        return SMPartitioner(None, config), ""
    table = encode_pool.submit(_load_or_profile, adapter, backend, profile_path, batch_sizes).result()
    return SMPartitioner(table, config), ""


def _load_or_profile(adapter, backend, path: str | None, batch_sizes) -> ProfileTable:
    if path and Path(path).is_file():
        log.info("loading the encode partition profile from %s", path)
        return ProfileTable.from_json(Path(path).read_text())
    t0 = time.monotonic()
    table = profile(measure_fn(adapter, backend), batch_sizes, backend.levels)
    log.info("profiled encode over %d batch sizes x %d shares in %.1f s", len(batch_sizes),
             len(backend.levels), time.monotonic() - t0)
    if path:
        Path(path).write_text(table.to_json())
    return table
