"""The 2x2 live stack (two prefill instances over shm and gRPC KV, two decode instances) and
the mixed requests the multi-instance tests send it."""
from __future__ import annotations

import concurrent.futures
import os

from easerve import Client
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.support.media import png_bytes


N = 6
STREAM_INTERVAL_MS = 200  # decode sends a stream's tokens at most every 200 ms (several tokens a message)


ONE = {"threads": 1}


def start_multi(model: str, *, restart: bool = False) -> Stack:
    cores = sorted(os.sched_getaffinity(0))
    decode = tuple(Worker(f"cpu:{cores[i % len(cores)]}",
                          flags={"num-slots": 8, "metrics-listen": f"127.0.0.1:{free_port()}",
                                 "stream-interval-ms": STREAM_INTERVAL_MS}) for i in range(2))
    d = Deployment(
        model=model, name="2x2",
        encode=(Worker(flags={"max-batch": 4, **ONE}),),
        prefill=tuple(Worker(flags={"kv-transport": kind, "metrics-listen": f"127.0.0.1:{free_port()}", **ONE})
                      for kind in ("shm", "grpc")),
        decode=decode).with_gateway_ports(0, 0)
    return Stack(d, restart=restart, env={"EASERVE_LOG_LEVEL": "WARNING"})


def mixed_requests():
    """(kind, kwargs for Client.generate): images, a video, text, in a mixed order."""
    frames = [png_bytes(56, 56, 40 + i) for i in range(4)]
    reqs = []
    for k in range(10):
        if k % 4 == 3:
            reqs.append(("text", {"prompt": f"Tell me about number {k}"}))
        elif k % 4 == 1:
            reqs.append(("video", {"prompt": "What happens?", "video": frames[k % 2:]}))
        else:
            reqs.append(("image", {"prompt": "What is this?", "images": [png_bytes(48 + 8 * k, 64, k)]}))
    return reqs


def run_all(stack, reqs, workers: int = 6) -> list[list[int]]:
    client = Client(stack.endpoints.grpc, timeout=180)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(lambda kw=kw: list(client.generate(max_tokens=N, **kw).token_ids)) for _, kw in reqs]
        return [f.result() for f in futs]


def scrape_stage(stack, name: str) -> str:
    import urllib.request
    argv = stack._procs[name].cmd.argv
    addr = argv[argv.index("--metrics-listen") + 1]
    return urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()


def kv_received(stack, name: str) -> dict[str, float]:
    """Requests whose KV this decode instance took in, by transport (its /metrics)."""
    import re
    text = scrape_stage(stack, name)
    out: dict[str, float] = {}
    for m in re.finditer(r'^easerve:kv_receive_seconds_count\{transport="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out
