"""The gateway's host path, live: its host CPU by phase (GET /metrics, GET /trace) after a request."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.media import data_uri, png_bytes

pytestmark = pytest.mark.slow


def _post(base: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _chat(content: list, max_tokens: int = 2) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]}]}


def _host_seconds(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith('easerve:host_cpu_seconds_total{') and 'stage="gateway"' in line:
            phase = line.split('phase="')[1].split('"')[0]
            out[phase] = float(line.split()[-1])
    return out


def test_gateway_exports_host_cpu_by_phase_and_per_request(vl_stack):
    base = vl_stack.endpoints.http
    model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
    body = _chat([{"type": "image_url", "image_url": {"url": data_uri(png_bytes(336, 448, seed=11))}}])
    body["model"] = model
    r = _post(base, body)
    assert r["usage"]["completion_tokens"] > 0
    seen = _host_seconds(urllib.request.urlopen(base + "/metrics", timeout=30).read().decode())
    assert seen["parse"] > 0 and seen["media"] > 0 and seen["tokenize"] > 0, seen
    recs = json.loads(urllib.request.urlopen(base + "/trace?last=50", timeout=30).read())["requests"]
    mine = [x for x in recs if x["request_id"] == r["id"]]
    assert len(mine) == 1, recs
    ms = mine[0]["host_cpu_ms"]
    assert ms["parse"] > 0 and ms["media"] > 0 and ms["tokenize"] > 0 and ms["detokenize"] > 0, ms


_POLLER = """
import http.client, json, sys, time
host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c, lat = http.client.HTTPConnection(host, port, timeout=10), []
import os
while not os.path.exists(stop):
    t0 = time.perf_counter()
    c.request("GET", "/health")
    c.getresponse().read()
    lat.append(time.perf_counter() - t0)
    time.sleep(0.01)
print(json.dumps(lat))
"""

_SENDERS = """
import concurrent.futures, json, os, sys, urllib.request
os.sched_setaffinity(0, {int(sys.argv[3])})
base, bodies = sys.argv[1], json.load(open(sys.argv[2]))
def post(body):
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]
with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
    print(json.dumps(list(ex.map(post, bodies))))
"""


def _lag_buckets(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return {ln.split('le="')[1].split('"')[0]: float(ln.split()[-1]) for ln in text.splitlines()
            if ln.startswith("easerve:gateway_event_loop_lag_seconds_bucket")}


def _pin(pids, cores) -> dict[int, set[int]]:
    """Every thread of each process in `pids` onto `cores`; returns what each thread had."""
    import os
    had = {}
    for pid in pids:
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            try:
                had[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                pass
    return had


def test_gateway_answers_health_within_50ms_under_16_videos(vl_stack, tmp_path):
    """16 concurrent requests of a 32-frame video each: the gateway keeps answering GET /health,
    every round trip under 50 ms (media decoding and the HF processor stay off its event loop).
    The poller is a process of its own, as a load balancer's probe is. As in a deployment, where
    the model stages run on their GPUs' cores and not the gateway's, the encode, prefill and decode
    processes are held to one core while the gateway, its media workers and the poller keep them all
    (else the measured round trip is this 2-core machine's scheduler, not the gateway). The 16
    senders, whose place is another machine, are a fresh process held to the model core too: run
    from this test process, whose heap a long session has grown, its own collections took a core
    for ~200 ms at a time beside the gateway (worst round trips of 62-71 ms after earlier tests)."""
    import subprocess
    import sys
    import time

    from hasctl.workload import WorkloadSpec, synthesize

    base = vl_stack.endpoints.http
    model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
    spec = WorkloadSpec(modality="video", video_frames=32, video_size=(320, 240), input_tokens=16, output_tokens=4)
    bodies = [dict(r.body(model), stream=False) for r in synthesize(spec, 16, seed=35)]
    for b in bodies:
        b.pop("stream_options")
    host, port = base.removeprefix("http://").split(":")
    stop = tmp_path / "stop"
    lag0 = _lag_buckets(base)
    import os
    models = [pid for name, pid in vl_stack.pids.items() if pid and not name.startswith("gateway")]
    assert len(models) >= 2, vl_stack.pids
    model_core = max(os.sched_getaffinity(0))
    body_file = tmp_path / "bodies.json"
    body_file.write_text(json.dumps(bodies))
    had = _pin(models, {model_core})
    try:
        poller = subprocess.Popen([sys.executable, "-c", _POLLER, host, port, str(stop)], stdout=subprocess.PIPE,
                                  text=True)
        time.sleep(0.5)
        t0 = time.perf_counter()
        sent = subprocess.run([sys.executable, "-c", _SENDERS, base, str(body_file), str(model_core)],
                              capture_output=True, text=True, timeout=600)
        busy_s = time.perf_counter() - t0
        stop.touch()
        lat = json.loads(poller.communicate(timeout=30)[0])
    finally:
        for tid, cores in had.items():
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                pass
    lag = {k: v - lag0.get(k, 0) for k, v in _lag_buckets(base).items()}
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert json.loads(sent.stdout) == [4] * 16, sent.stdout
    assert len(lat) >= busy_s / 0.1, (len(lat), busy_s)  # the poller ran throughout the load
    worst = sorted(round(x * 1e3) for x in lat)[-8:]
    assert worst[-1] < 50, f"worst /health round trips {worst} ms of {len(lat)}; loop lag histogram {lag}"
