"""Co-located prefill and the SM partition it runs under.

At start-up the encode worker measures its encode latency over batch sizes x share
levels on the live backend (`profiler.startup_profile`), or loads the encode grid of an
`easerve.profile/v1` file (`--partition-profile`: the worker's own from an earlier start,
or one `hasctl profile` wrote), and the partitioner keeps, per batch size, the smallest
share within tolerance of the exclusive latency. Each micro-batch then runs under its
share; the co-located prefill runs concurrently, on its own thread, under the rest.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

from easerve.partition.backends import PartitionController, select_backend
from easerve.policy.partitioner import FixedPartitioner, LatencyGrid, PartitionerConfig, SMPartitioner, policy_levels
from easerve.stages.encode.profiler import startup_profile
from easerve import profile_format as pf

log = logging.getLogger("easerve.encode")


def build_controller(adapter, device: str, backend_pref: str, policy: str, profile_path: str | None,
                     batch_sizes: tuple[int, ...], tolerance: float,
                     encode_pool: concurrent.futures.Executor,
                     prefill_pool: concurrent.futures.Executor, *, model: str = "") -> PartitionController:
    """Pick the backend for the policy's levels, pin the two worker threads, then (dynamic
    policy on a backend that can switch) profile encode on the encode thread itself, so the
    measured shares are the ones it will run under (`model`: the checkpoint folder the
    written profile records). A backend that cannot be had raises
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
    part, note = _partitioner(adapter, (model, device), backend, config, profile_path, batch_sizes, encode_pool)
    if note:
        log.warning("%s", note)
    if part.policy == "static":
        r = backend.realized(0)
        log.info("static split: encode %.3f, prefill %.3f of the device", r.encode_share, r.prefill_share)
    return PartitionController(part, backend, note)


def _partitioner(adapter, where: tuple[str, str], backend, config: PartitionerConfig, profile_path, batch_sizes,
                 encode_pool):
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
    grid = encode_pool.submit(_load_or_measure, adapter, where, backend, profile_path, batch_sizes).result()
    return SMPartitioner(grid, config), ""


def _load_or_measure(adapter, where: tuple[str, str], backend, path: str | None, batch_sizes) -> LatencyGrid:
    """The latency grid of the profile at `path` if it exists, else measured here (and written
    to `path` as an encode-scope easerve.profile/v1 file, so a restart reuses it). `where`:
    (model folder, torch device)."""
    if path and Path(path).is_file():
        log.info("loading the encode grid of the profile %s", path)
        enc = pf.load(path, require="encode").encode
        if enc.backend != backend.name:
            log.warning("the profile %s was measured on the %s backend; this worker runs %s", path,
                        enc.backend, backend.name)
        return LatencyGrid.from_points((p.batch_size, p.share, p.latency_s) for p in enc.grid)
    t0 = time.monotonic()
    prof = startup_profile(adapter, backend, *where, batch_sizes)
    log.info("profiled encode over %d batch sizes x %d shares in %.1f s", len(batch_sizes),
             len(backend.levels), time.monotonic() - t0)
    if path:
        pf.dump(prof, path)
    return LatencyGrid.from_points((p.batch_size, p.share, p.latency_s) for p in prof.encode.grid)
