"""The host path: what the CPU spends per request outside the model (issue 35), in one run.

1. framework: the tiny checkpoint (negligible compute) through the full stack (`default`) and the
   monolith, a 448x336 image + ~64 prompt words + 64 output tokens, closed loops of 1 and 16
   (`hasctl bench --max-concurrency`): core-ms per request = CPU (utime + stime from /proc) of
   every stage process and its children (the gateway's media workers), the load client excluded;
   max requests/s; the deployments up together and measured in turns, 3 rounds, each one's median
   run reported. Also the gateway's /health round trip (p99) under 16 concurrent 32-frame videos,
   and TTFT at concurrency 1 of `default` over `dynamo-like`.
2. media: our decode path (the gateway's DecodePool: worker CPU + hashing) + a PIL resize, per
   item, against the floor (PIL / PyAV decode of the same frames + the same resize, in-process),
   on inputs made here: a 448x336 JPEG, a 1920x1080 JPEG and PNG, 8 and 32 frames of a 10 s 720p
   H.264 clip, 10 s and 60 s of audio (AAC). `ours_gateway_core_ms`: the part of ours spent in
   the gateway's own process (hashing, the hop to the worker and back, the resize), not the worker.
3. movement: embeddings and KV at published sizes over each transport of bench/kv_transport.py
   (shm, shm_copy, grpc) against a memcpy: wall ms and core-ms (sender + receiver CPU) per MB.

Last stdout line: one JSON object, the issue's keys first, raw figures beside them.

    python bench/host_path.py [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import results, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from hasctl.profile_host import tree_cpu_s  # noqa: E402

# published sizes: (embedding rows, hidden) of one item; KV (layers, kv heads, head dim)
MODELS = {"qwen2.5-vl-7b": ((192, 3584), (28, 4, 128)),       # one 448x336 image
          "llava-next-34b": ((2880, 7168), (60, 8, 128)),      # one anyres image (5 x 576 rows)
          "ultravox-llama-3.1-8b": ((63, 4096), (32, 8, 128))}  # 10 s of audio


# ---- 1. framework cost ------------------------------------------------------------------------
def bench_once(url: str, spec, n: int, conc: int, pids: list[int], seed: int) -> dict:
    """`seed`: the requests' media and prompts; a seed used twice on one stack measures its
    encoder and prefix caches, not the path."""
    from hasctl.bench import BenchConfig, run_bench

    cfg = BenchConfig(url=url, rate=1e6, num_requests=n, max_concurrency=conc, workload=spec, ignore_eos=True,
                      progress=False, seed=seed)
    cpu0 = tree_cpu_s(pids)
    res = asyncio.run(run_bench(cfg))
    cpu = tree_cpu_s(pids) - cpu0
    m = res.metrics
    done = max(1, m["completed"])
    return {"core_ms_per_request": round(cpu * 1e3 / done, 1), "requests_s": round(m["request_throughput"], 2),
            "median_ttft_ms": round(m["median_ttft_ms"] or 0, 1), "failed": m["failed"]}


def health_p99_ms(base: str, run) -> float:
    """p99 of GET /health round trips, every ~20 ms, while `run()` runs."""
    import http.client

    host, port = base.removeprefix("http://").split(":")
    lat, stop = [], threading.Event()

    def poll():
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        while not stop.is_set():
            t0 = time.perf_counter()
            c.request("GET", "/health")
            c.getresponse().read()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    try:
        run()
    finally:
        stop.set()
        t.join()
    return round(float(np.percentile(lat, 99)) * 1e3, 1)


WARM_SEED = 99  # the warm-up's requests; each measured run has a seed of its own (fresh media, fresh prompts)


def median_run(runs: list[dict]) -> dict:
    """The run with the median core-ms per request, with every run's figure beside it."""
    mid = sorted(runs, key=lambda r: r["core_ms_per_request"])[len(runs) // 2]
    return {**mid, "core_ms_runs": [r["core_ms_per_request"] for r in runs],
            "median_ttft_ms_runs": [r["median_ttft_ms"] for r in runs]}


def framework(args, model: str) -> dict:
    """The three deployments up at once and measured in turns (`default`, `monolith`,
    `dynamo-like`; --repeats rounds), so that a slow minute of the machine falls on all of them:
    the figures are each one's median run, every run kept beside it."""
    from hasctl.workload import WorkloadSpec

    image = WorkloadSpec(modality="image", image_size=(448, 336), input_tokens=64, output_tokens=64)
    video = WorkloadSpec(modality="video", video_frames=32, video_size=(320, 240), input_tokens=16, output_tokens=4)
    n1, n16 = (4, 32) if args.quick else (20, 160)
    names = ("default", "monolith", "dynamo-like")
    stacks = stack.start_all({n: (lambda n=n: stack.start(stack.deployment(model, n, threads=None))) for n in names})
    try:
        ends = {n: (st.endpoints.http, [p for p in st.pids.values() if p]) for n, st in stacks.items()}
        for n in names:
            bench_once(ends[n][0], image, 2, 1, ends[n][1], seed=WARM_SEED)
        runs: dict[str, list[dict]] = {}
        for r in range(args.repeats):
            for n in names:
                url, pids = ends[n]
                runs.setdefault(f"{n}_c1", []).append(bench_once(url, image, n1, 1, pids, seed=10 * r + 1))
            for n in ("default", "monolith"):
                url, pids = ends[n]
                runs.setdefault(f"{n}_c16", []).append(bench_once(url, image, n16, 16, pids, seed=10 * r + 2))
            print(f"round {r + 1}", {k: v[-1]["core_ms_per_request"] for k, v in runs.items()}, flush=True)
        out: dict = {k: median_run(v) for k, v in runs.items()}
        out["stack_over_monolith_c16_runs"] = [round(a["core_ms_per_request"] / b["core_ms_per_request"], 3)
                                               for a, b in zip(runs["default_c16"], runs["monolith_c16"])]
        url, pids = ends["default"]
        out["gateway_health_p99_ms"] = health_p99_ms(url, lambda: bench_once(url, video, 16, 16, pids, seed=3))
    finally:
        stack.stop_all(stacks)
    return out


# ---- 2. media vs the floor ----------------------------------------------------------------------
def media_inputs() -> dict[str, tuple[str, bytes, float | None]]:
    """name -> (kind, file bytes, video fps to sample at)."""
    import av
    from PIL import Image

    rng = np.random.default_rng(0)

    def picture(w, h):
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) % 256)], -1) + rng.integers(0, 30, (h, w, 3))
        return Image.fromarray(arr.clip(0, 255).astype(np.uint8))

    def save(im, fmt):
        buf = io.BytesIO()
        im.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        return buf.getvalue()

    def clip(seconds=10, w=1280, h=720, fps=30):
        base = np.asarray(picture(w, h))
        buf = io.BytesIO()
        with av.open(buf, mode="w", format="mp4") as c:
            s = c.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "23"})
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            for t in range(seconds * fps):
                for p in s.encode(av.VideoFrame.from_ndarray(np.roll(base, 4 * t, axis=1), format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        return buf.getvalue()

    def audio(seconds):
        buf, rate = io.BytesIO(), 44100
        with av.open(buf, mode="w", format="ipod") as c:
            s = c.add_stream("aac", rate=rate)
            t = np.arange(seconds * rate) / rate
            pcm = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            for k in range(0, len(pcm), 1024):
                f = av.AudioFrame.from_ndarray(pcm[None, k:k + 1024], format="flt", layout="mono")
                f.sample_rate = rate
                for p in s.encode(f):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        return buf.getvalue()

    mp4 = clip()
    return {"jpeg_448x336": ("image", save(picture(448, 336), "JPEG"), None),
            "jpeg_1920x1080": ("image", save(picture(1920, 1080), "JPEG"), None),
            "png_1920x1080": ("image", save(picture(1920, 1080), "PNG"), None),
            "video_8_frames": ("video", mp4, 0.8), "video_32_frames": ("video", mp4, 3.2),
            "audio_10s": ("audio", audio(10), None), "audio_60s": ("audio", audio(60), None)}


def resize(frames: np.ndarray) -> None:
    """What both sides pay after decoding: each frame to at most 448x336 (PIL bicubic)."""
    from PIL import Image

    for f in frames.reshape(-1, *frames.shape[-3:]):
        im = Image.fromarray(f)
        im.resize((448, 336), Image.BICUBIC)


def floor_cpu_s(kind: str, raw: bytes, fps: float | None) -> float:
    """The library alone: PIL decode; PyAV decode (every frame up to the last kept, converting the
    kept ones); PyAV decode + resample for audio. Then the same resize."""
    import av
    from PIL import Image

    t0 = time.process_time()
    if kind == "image":
        resize(np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))[None])
    elif kind == "video":
        with av.open(io.BytesIO(raw)) as c:
            s = c.streams.video[0]
            s.thread_type = "AUTO"
            total = s.frames or 300
            keep = set(int(k * total / int(fps * 10)) for k in range(int(fps * 10)))
            kept = [f.to_ndarray(format="rgb24") for i, f in zip(range(max(keep) + 1), c.decode(s)) if i in keep]
        resize(np.stack(kept))
    else:
        with av.open(io.BytesIO(raw)) as c:
            r = av.AudioResampler(format="flt", layout="mono", rate=16000)
            np.concatenate([x.to_ndarray().ravel() for f in c.decode(audio=0) for x in r.resample(f)])
    return time.process_time() - t0


def ours_cpu_s(pool, loop, kind: str, raw: bytes, fps: float | None) -> tuple[float, float]:
    """The gateway's path: hash + DecodePool (a worker's CPU, or this process's thread for a small
    image) + the same resize; (in all, of this process alone: what the gateway's own cores pay)."""
    t0 = time.process_time()
    opts = {"image": (8192, 256_000_000), "audio": (16000, 600.0, ""),
            "video": (8192, 1024, 256_000_000, 108_000, fps, 1, 768, 1)}[kind]
    key = pool.key(kind, raw, opts)
    d, _ = loop.run_until_complete(pool.decode(kind, raw, opts, key))  # one loop, as the gateway's lives on
    pool._done.clear()  # every repeat decodes (no cache hit)
    if kind != "audio":
        resize(d.array if kind == "video" else d.array[None])
    here = time.process_time() - t0
    return here + (0.0 if d.in_thread else d.cpu_s), here  # a thread's CPU is this process's


def media(args) -> dict:
    from easerve.media.pool import DecodePool

    pool = DecodePool(workers=1)
    pool.start()
    loop = asyncio.new_event_loop()
    reps = 2 if args.quick else 7
    out = {}
    try:
        for name, (kind, raw, fps) in media_inputs().items():
            floor = min(floor_cpu_s(kind, raw, fps) for _ in range(reps))
            ours, here = min(ours_cpu_s(pool, loop, kind, raw, fps) for _ in range(reps))
            out[name] = {"ours_core_ms": round(ours * 1e3, 2), "ours_gateway_core_ms": round(here * 1e3, 2),
                         "floor_core_ms": round(floor * 1e3, 2),
                         "over_floor": round(ours / floor, 3)}
            print("media", name, out[name], flush=True)
    finally:
        loop.close()
        pool.close()
    out["decoder"] = pool.decoder
    return out


# ---- 3. movement ----------------------------------------------------------------------------------
def movement(args) -> dict:
    import multiprocessing as mp

    import torch

    from bench.kv_transport import MAX_MSG, copy_warm, make_kv, receiver, transfer
    from easerve.transport.grpc_stream import GrpcStreamConfig, GrpcStreamTransport
    from easerve.transport.shm import ShmTransport
    from easerve.wire import codec

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,), daemon=True)
    proc.start()
    port = parent.recv()
    kv_tokens, reps = (256, 2) if args.quick else (1024, 5)
    out: dict = {}

    async def one(payload) -> dict:
        header, tensors = codec.kv_to_parts(payload)
        mb = codec.frame_size(header) / 1e6
        txs = {"shm": ShmTransport(), "grpc": GrpcStreamTransport(
            peer=f"127.0.0.1:{port}", config=GrpcStreamConfig(), channel_options=[("grpc.max_send_message_length", MAX_MSG)])}
        dst = [torch.empty_like(t) for t in tensors]
        row = {"mb": round(mb, 2)}
        c0 = time.thread_time()
        wall = min(copy_warm(tensors, dst) for _ in range(reps + 1))
        row["memcpy"] = {"wall_ms_per_mb": round(wall * 1e3 / mb, 4),
                         "core_ms_per_mb": round((time.thread_time() - c0) / (reps + 1) * 1e3 / mb, 4)}
        for mode, tx in (("shm", txs["shm"]), ("shm_copy", txs["shm"]), ("grpc", txs["grpc"])):
            await transfer(mode, tx, parent, header, tensors)  # warm-up
            walls = []
            cpu0 = tree_cpu_s([os.getpid(), proc.pid])
            for _ in range(reps):
                walls.append(await transfer(mode, tx, parent, header, tensors))
            cpu = (tree_cpu_s([os.getpid(), proc.pid]) - cpu0) / reps
            row[mode] = {"wall_ms_per_mb": round(min(walls) * 1e3 / mb, 4), "core_ms_per_mb": round(cpu * 1e3 / mb, 4),
                         "over_memcpy": round(min(walls) / wall, 2)}
        await txs["grpc"].close()
        await txs["shm"].close()
        return row

    try:
        for name, ((rows, hidden), (layers, heads, dim)) in MODELS.items():
            out[f"{name}_embeddings"] = asyncio.run(one(make_kv(1, rows, 1, hidden // 2)))  # rows x hidden bf16
            out[f"{name}_kv"] = asyncio.run(one(make_kv(layers, kv_tokens, heads, dim)))
            print("movement", name, out[f"{name}_embeddings"], out[f"{name}_kv"], flush=True)
    finally:
        parent.send(None)
        proc.join(30)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few requests and repeats: checks the script, not a result")
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen2.5-VL build)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--repeats", type=int, default=None, help="framework rounds (default 3, 1 with --quick)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: framework, media, movement "
                    "(a partial run is not saved unless --save says so)")
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    args.repeats = args.repeats or (1 if args.quick else 3)
    if skip and args.save is None:  # a partial result must not replace the stored full one
        args.save = False
    model = checkpoint(args.model, args.cache_dir, scale="tiny")
    fw = framework(args, model) if "framework" not in skip else {}
    md = media(args) if "media" not in skip else {}
    mv = movement(args) if "movement" not in skip else {}
    transports = [v for row in mv.values() for k, v in row.items() if k in ("shm", "shm_copy", "grpc")]
    head = {
        "framework_core_ms_per_request_c16": fw.get("default_c16", {}).get("core_ms_per_request"),
        "framework_core_ms_stack_over_monolith": round(fw["default_c16"]["core_ms_per_request"]
                                                       / fw["monolith_c16"]["core_ms_per_request"], 3) if fw else None,
        "media_over_floor_max": max((v["over_floor"] for v in md.values() if isinstance(v, dict)), default=None),
        "movement_over_memcpy_max": max((t["over_memcpy"] for t in transports), default=None),
        "movement_core_ms_per_mb_max": max((t["core_ms_per_mb"] for t in transports), default=None),
        "gateway_loop_lag_p99_ms": fw.get("gateway_health_p99_ms"),
        "ttft_c1_default_over_dynamo_like": round(fw["default_c1"]["median_ttft_ms"]
                                                  / fw["dynamo-like_c1"]["median_ttft_ms"], 3) if fw else None,
    }
    results.finish("host_path", args, {**head, "quick": args.quick, "framework": fw, "media": md, "movement": mv,
                                       "model": Path(model).name}, argv)


if __name__ == "__main__":
    main()
