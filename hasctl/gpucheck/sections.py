"""The GPU check's sections; `python -m hasctl.gpucheck.sections NAME [--dry-run]` runs one
and prints its result as one JSON line. `--dry-run` runs the same code on CPU against
stand-ins: the fake driver and torch.cuda of `hasctl.gpucheck.fakes` for green contexts,
the shared-memory transport in one process for CUDA IPC, CPU decode, a CPU stack."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEVELS = (0.25, 0.5, 0.75, 1.0)


def _torch():
    import torch
    return torch


def _green(dry: bool, levels=LEVELS, **kw):
    from easerve.partition.green_contexts import GreenContextBackend
    if dry:
        from hasctl.gpucheck.fakes import FakeDriver, fake_torch
        drv = FakeDriver()
        return GreenContextBackend(levels, driver=drv, torch=fake_torch(drv, "fake H200 (dry run)"), **kw)
    return GreenContextBackend(levels, **kw)


def _gemm(device: str, n: int, reps: int = 4) -> None:
    torch = _torch()
    x = torch.ones(n, n, device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    for _ in range(reps):
        x = torch.tanh(x @ x / n)


def preflight(dry: bool) -> dict:
    torch = _torch()
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": None, "sms": None, "round_trip": {}}
    dev = "cpu" if dry else "cuda:0"
    if not dry:
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    b = _green(dry, (0.5, 1.0))
    out["green"] = b.reason
    for side, scope in (("encode", b.encode_context), ("prefill", b.prefill_context)):
        t0 = time.perf_counter()
        with scope(0) as s:  # split -> context -> stream -> GEMM -> event
            _gemm(dev, 128 if dry else 1024)
            if not dry:
                ev = torch.cuda.Event()
                ev.record(s)
        if not dry:
            ev.synchronize()
        out["round_trip"][side] = {"ok": True, "ms": round((time.perf_counter() - t0) * 1e3, 3),
                                   "sms": (b.encode_sms if side == "encode" else b.prefill_sms)[0]}
    b.close()
    return out


def green(dry: bool) -> dict:
    from easerve.policy.partitioner import Allocation
    levels = {}
    for share in LEVELS[:-1]:
        t0 = time.perf_counter()
        b = _green(dry, (share, 1.0))
        create_ms = (time.perf_counter() - t0) * 1e3
        switch = []
        for i in range(50):
            t1 = time.perf_counter()
            b.apply(Allocation(share if i % 2 else 1.0, 0.0))
            with b.encode_context(sync=False):
                pass
            switch.append(time.perf_counter() - t1)
        levels[str(share)] = {"encode_sms": b.encode_sms[0], "prefill_sms": b.prefill_sms[0],
                              "total_sms": b.total_sms, "create_ms": round(create_ms, 3),
                              "switch_us_median": round(statistics.median(switch) * 1e6, 2)}
        b.close()
    return {"levels": levels}


def colocation(dry: bool) -> dict:
    """Encode-like GEMM bursts (their latency) beside a prefill-like GEMM stream (its rate),
    under each policy's backend."""
    import threading

    from easerve.policy.partitioner import Allocation
    from easerve.partition.backends import select_backend
    dev = "cpu" if dry else "cuda:0"
    if dry:
        _torch().set_num_threads(1)  # two Python threads on a shared CPU: no oversubscription
    n_enc, n_pre, bursts = (96, 192, 8) if dry else (2048, 8192, 60)
    out = {}
    for policy, pref in (("timeslice", "timeslice"), ("static", "static"), ("dynamic", "auto")):
        try:
            b = select_backend(pref, dev, (0.25, 0.5, 0.75, 1.0) if policy == "dynamic" else (1.0,))
        except Exception as e:  # noqa: BLE001 - reported per policy
            out[policy] = {"error": str(e)}
            continue
        stop, done = threading.Event(), [0]

        def prefill() -> None:
            while not stop.is_set():
                with b.prefill_context():
                    _gemm(dev, n_pre, 2)
                done[0] += 1

        th = threading.Thread(target=prefill, daemon=True)
        t0 = time.perf_counter()
        th.start()
        lat = []
        for _ in range(bursts):
            b.apply(Allocation(0.5, 0.5))
            t1 = time.perf_counter()
            with b.encode_context():
                _gemm(dev, n_enc, 8)
            lat.append(time.perf_counter() - t1)
        stop.set()
        th.join()
        wall = time.perf_counter() - t0
        lat.sort()
        out[policy] = {"backend": b.name, "encode_p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 3),
                       "prefill_tokens_per_s": round(done[0] * 2 * n_pre / wall, 1), "reason": b.reason}
        b.close()
    return out


def ipc(dry: bool) -> dict:
    """KV hand-off GB/s at 58 MB and 470 MB vs a device copy (dry run: a tenth of the sizes,
    the shared-memory transport in this process)."""
    import asyncio
    torch = _torch()
    sizes = (58_000_000, 470_000_000)
    out = {}
    for size in sizes:
        n = (size // 10 if dry else size) // 2 // 1024 * 1024  # fp16 elements, whole [8 heads x 64] rows
        x = torch.ones(n, dtype=torch.float16, device="cpu" if dry else "cuda:0")
        t0 = time.perf_counter()
        y = x.clone()
        if not dry:
            torch.cuda.synchronize()
        copy_s = time.perf_counter() - t0
        del y
        gbps = asyncio.run(_shm_round(x) if dry else _cuda_ipc_round(x))
        out[f"{size // 1_000_000}MB"] = {"bytes": x.numel() * 2, "transport_gbps": round(gbps, 4),
                                         "device_copy_gbps": round(x.numel() * 2 / copy_s / 1e9, 4)}
    out["transport"] = "shm in one process (dry run)" if dry else "cuda_ipc to a second process"
    return out


def _kv_parts(x):
    """Codec parts of a one-layer KV payload holding x's bytes (K and V each half)."""
    from easerve.wire.codec import kv_to_parts
    from easerve.types import KVPayload, SamplingParams
    k, v = x.view(2, 1, 8, -1, 64)
    return kv_to_parts(KVPayload("gpu-check", [k], [v], k.shape[2], 0, 1, SamplingParams(max_tokens=1)))


async def _shm_round(x) -> float:
    from easerve.transport.shm import ShmConfig, ShmTransport
    header, tensors = _kv_parts(x)
    tx, rx = ShmTransport(), ShmTransport(ShmConfig(copy_out=True))
    t0 = time.perf_counter()
    h = await tx.send("gpu-check", header, tensors)
    await rx.recv(h)
    dt = time.perf_counter() - t0
    tx.release(h)
    await tx.close()
    await rx.close()
    return x.numel() * x.element_size() / dt / 1e9


def _ipc_child(conn) -> None:
    import asyncio

    from easerve.transport.cuda_ipc import CudaIpcTransport
    from easerve.transport.handles import handle_from_proto
    from easerve.wire.v1 import kv_pb2
    rx = CudaIpcTransport()
    h = handle_from_proto(kv_pb2.KVTransfer.FromString(conn.recv()))
    t0 = time.perf_counter()
    asyncio.run(rx.recv(h))
    conn.send(time.perf_counter() - t0)


async def _cuda_ipc_round(x) -> float:
    """Send from this process, receive (map, copy, synchronize) in a spawned one."""
    import multiprocessing as mp

    from easerve.transport.cuda_ipc import CudaIpcTransport
    from easerve.transport.handles import handle_to_proto
    header, tensors = _kv_parts(x)
    tx = CudaIpcTransport()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child,), daemon=True)
    proc.start()
    _torch().cuda.synchronize()
    t0 = time.perf_counter()
    h = await tx.send("gpu-check", header, tensors)
    parent.send(handle_to_proto(h).SerializeToString())
    recv_s = parent.recv()
    total = time.perf_counter() - t0
    tx.release(h)
    proc.join(30)
    nbytes = x.numel() * x.element_size()
    return nbytes / recv_s / 1e9 if total > 0 else 0.0


def decode(dry: bool) -> dict:
    """Decode tok/s at batch 1/16/64: the engine's slot layout and paged layout (flashinfer
    where installed, else the gather path) with HF's decode, on the bench model and on a
    4-layer LM shaped like a 7B (head_dim 128, GQA group 7)."""
    batches = "1,4" if dry else "1,16,64"
    steps = "4" if dry else "32"
    dev = "cpu" if dry else "cuda"
    seven_b = {"family": "qwen2", "hidden": 3584, "layers": 4, "heads": 28, "kv_heads": 4, "intermediate": 18944,
               "vocab": 152064}
    bench = ["--text-lm"]
    if dry:  # same shapes' kinds at toy size: head_dim 16, GQA group 7
        seven_b = {"family": "qwen2", "hidden": 224, "layers": 2, "heads": 14, "kv_heads": 2, "intermediate": 448,
                   "vocab": 512}
        bench = ["--text-lm-spec", json.dumps({"vocab": 512})]
    runs = {}
    for model, extra in (("bench", bench), ("7b_shaped_4_layers", ["--text-lm-spec", json.dumps(seven_b)])):
        for layout in ("slots", "paged"):
            argv = [sys.executable, str(ROOT / "bench" / "decode_batching.py"), *extra, "--device", dev,
                    "--batches", batches, "--steps", steps, "--layout", layout, "--prompt-len", "32", "--no-save"]
            p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            try:
                got = json.loads(last) if p.returncode == 0 else None
            except ValueError:
                got = None
            runs[f"{model}/{layout}"] = got if isinstance(got, dict) else {
                "error": f"exit {p.returncode}: {p.stderr.strip()[-800:]}"}
    return runs


def e2e(dry: bool) -> dict:
    """`hasctl up --device cuda:0 --preset colocated` (dry run: --device cpu) answering chat
    requests: startup seconds, TTFT per request, and the backends its logs name."""
    import urllib.request

    from easerve.models.tiny import DEFAULT_FAMILY, cached_tiny
    from hasctl.deployment import preset
    from hasctl.launch import Stack
    model = str(cached_tiny(DEFAULT_FAMILY, str(ROOT / "runs" / "tiny")))
    dep = preset("colocated").with_model(model).with_device("cpu" if dry else "cuda:0").with_gateway_ports(0, 0)
    t0 = time.perf_counter()
    with Stack(dep) as stack:
        startup = time.perf_counter() - t0
        http = stack.endpoints.http
        served = json.loads(urllib.request.urlopen(http + "/v1/models", timeout=30).read())["data"][0]["id"]
        ttft = []
        for i in range(4 if dry else 16):
            body = {"model": served, "max_tokens": 8, "stream": True,
                    "messages": [{"role": "user", "content": f"Say something about {i}."}]}
            req = urllib.request.Request(http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t1 = time.perf_counter()
            first = None
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t1
            ttft.append(first)
        logs = "\n".join(p.read_text(errors="replace") for p in Path(stack.run_dir).rglob("*.log"))
    used = sorted({ln.split("] ", 1)[-1][:160] for ln in logs.splitlines()
                   if "SM backend" in ln or " over " in ln and "KV to" in ln or "attention backend" in ln})
    ok = [t for t in ttft if t is not None]
    return {"startup_s": round(startup, 2), "requests": len(ttft), "answered": len(ok),
            "ttft_ms_median": round(statistics.median(ok) * 1e3, 2) if ok else None, "backends": used}


SECTIONS = {"preflight": preflight, "green_contexts": green, "colocation": colocation, "cuda_ipc": ipc,
            "decode": decode, "e2e": e2e}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("section", choices=sorted(SECTIONS))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    result = SECTIONS[args.section](args.dry_run)
    print(json.dumps(result, default=str), flush=True)
    # a part that failed (a policy's backend, a decode run) fails the section, its figures kept
    return 1 if any(isinstance(v, dict) and "error" in v for v in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
