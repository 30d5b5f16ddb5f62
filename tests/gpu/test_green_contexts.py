"""Green-context SM partitioning on a real GPU: switch cost, disjointness, co-location gain.

Prints its figures (with the device name); run with `-s` to see them:
    python -m pytest tests/gpu/test_green_contexts.py -m gpu -s -q
"""
from __future__ import annotations

import json
import time

import pytest

from easerve.partition.backends import TimeSliceBackend
from easerve.partition.green_contexts import GreenContextBackend
from easerve.policy.partitioner import Allocation, PartitionerConfig, SMPartitioner, measure_grid

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
_ok, _why = GreenContextBackend.probe()
if not _ok:
    pytest.skip(f"green contexts unsupported: {_why}", allow_module_level=True)

HID = 1152  # a SigLIP-like vision width; 576 patches per image
DEV = "cuda:0"


@pytest.fixture(scope="module")
def backend():
    b = GreenContextBackend()
    print(f"\n[{torch.cuda.get_device_name(0)}] {b.reason}")
    yield b
    b.close()


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    w_enc = torch.randn(HID, HID, device=DEV, dtype=torch.bfloat16, generator=g) / HID ** 0.5
    w_pre = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16, generator=g) / 64
    return w_enc, w_pre


def encode_like(batch: int, w: torch.Tensor, layers: int = 12) -> torch.Tensor:
    x = torch.ones(batch * 576, HID, device=DEV, dtype=torch.bfloat16)
    for _ in range(layers):
        x = torch.tanh(x @ w)
    return x


def prefill_like(w: torch.Tensor, steps: int) -> None:
    x = torch.ones(4096, 4096, device=DEV, dtype=torch.bfloat16)
    for _ in range(steps):
        x = torch.tanh(x @ w)


def timed(fn, stream) -> float:
    """Seconds of GPU time for fn() enqueued on `stream`."""
    return _timed_ctx(torch.cuda.stream(stream), fn)


def test_switch_cost_is_stream_picking(backend) -> None:
    allocs = [Allocation(s, round(1 - s, 9)) for s in backend.levels]
    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        backend.apply(allocs[i % len(allocs)])
    apply_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n // 10):
        with backend.encode_context(i % len(allocs)):
            pass
    enter_us = (time.perf_counter() - t0) / (n // 10) * 1e6
    print(f"[{torch.cuda.get_device_name(0)}] apply(): {apply_us:.3f} us, "
          f"enter encode stream context: {enter_us:.3f} us")
    assert apply_us < 20 and enter_us < 200


def test_every_level_computes_correctly(backend, weights) -> None:
    ref = encode_like(2, weights[0])
    torch.cuda.synchronize()
    for lv in range(len(backend.levels)):
        for ctx in (backend.encode_context(lv), backend.prefill_context(lv)):
            with ctx:
                out = encode_like(2, weights[0])
            torch.cuda.synchronize()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=f"level {lv}")


def test_encode_and_prefill_partitions_are_disjoint(backend, weights) -> None:
    """Both sides saturate their own SMs: concurrent time ~ max of the two if the partitions
    are disjoint, ~ their sum if they overlap."""
    lv = min(range(len(backend.levels)), key=lambda i: abs(backend.levels[i] - 0.5))
    enc_s, pre_s = backend.encode_stream(lv), backend.prefill_stream(lv)
    w = weights[1]
    prefill_like(w, 5)  # warm-up
    torch.cuda.synchronize()
    a = timed(lambda: prefill_like(w, 40), enc_s)
    p = timed(lambda: prefill_like(w, 40), pre_s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(enc_s):
        prefill_like(w, 40)
    with torch.cuda.stream(pre_s):
        prefill_like(w, 40)
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    print(f"[{torch.cuda.get_device_name(0)}] level {backend.levels[lv]} "
          f"(SMs {backend.encode_sms[lv]}+{backend.prefill_sms[lv]}): encode side alone "
          f"{a * 1e3:.1f} ms, prefill side alone {p * 1e3:.1f} ms, both {both * 1e3:.1f} ms")
    assert both < 0.85 * (a + p), "partitions overlap: concurrent work serialized"


def test_latency_grid_and_colocation_gain(backend, weights) -> None:
    w_enc, w_pre = weights
    sizes = (1, 2, 4, 8)

    def measure(b: int, share: float) -> float:
        s = backend.encode_stream(backend.level_for(share))
        encode_like(b, w_enc)
        return min(timed(lambda: encode_like(b, w_enc), s) for _ in range(3))

    grid = measure_grid(measure, sizes, backend.levels)
    part = SMPartitioner(grid, PartitionerConfig(tolerance=0.1))
    chosen = {b: part.choose(b).encode_share for b in sizes}
    print(f"[{torch.cuda.get_device_name(0)}] encode latency ms by share {grid.shares}:")
    for b, row in zip(grid.batch_sizes, grid.latency_s):
        print(f"  batch {b}: " + " ".join(f"{v * 1e3:.2f}" for v in row) + f" -> share {chosen[b]}")

    slicer = TimeSliceBackend(DEV)
    results = {name: colocated_run(be, part, w_enc, w_pre)
               for name, be in (("dynamic", backend), ("timeslice", slicer))}
    d, t = results["dynamic"], results["timeslice"]
    ratios = {"encode_p50_speedup_vs_timeslice": round(t["encode_p50_ms"] / d["encode_p50_ms"], 3),
              "makespan_ratio_vs_timeslice": round(t["makespan_ms"] / d["makespan_ms"], 3)}
    print(f"[{torch.cuda.get_device_name(0)}] co-location " + json.dumps({**ratios, **results}))
    for r in results.values():
        assert r["encode_p50_ms"] > 0 and r["makespan_ms"] > 0


def colocated_run(be, part: SMPartitioner, w_enc, w_pre, rounds: int = 24) -> dict:
    """Encode micro-batches of varying size back to back; before each, one chunk of prefill
    work is enqueued on the prefill stream of the level chosen for that batch (chunks chained
    with events, as a real prefill's layers would be)."""
    sizes = [1, 8, 2, 4] * (rounds // 4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    lat, prev = [], None
    for b in sizes:
        lv = be.apply(part.choose(b))
        with be.prefill_context(lv, sync=False):  # keep running beside the next encode
            if prev is not None:
                torch.cuda.current_stream().wait_event(prev)
            prefill_like(w_pre, 6)
            prev = torch.cuda.Event()
            prev.record()
        lat.append(_timed_ctx(be.encode_context(lv, sync=False), lambda: encode_like(b, w_enc)))
    torch.cuda.synchronize()
    lat.sort()
    return {"backend": be.name, "encode_p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
            "encode_max_ms": round(lat[-1] * 1e3, 3),
            "makespan_ms": round((time.perf_counter() - t0) * 1e3, 2)}


def _timed_ctx(ctx, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ctx:
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
