"""The static 50/50 baseline on live processes: two co-located encode workers, one with
--partition-policy static and one with --sm-backend static (the spelling that failed on the
latency grid before), serve requests, and /partition, /trace and /metrics report share 0.5
for encode and for its local prefill. An encode worker on one core with a named mechanism
fails its start naming --sm-backend; with auto it starts and says it is degraded."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from hasctl.deployment import Worker, preset
from hasctl.launch import Stack, free_port
from tests.support.media import png_bytes
from tests.support.prom import metric

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def _get(addr: str, path: str) -> str:
    return urllib.request.urlopen(f"http://{addr}{path}", timeout=10).read().decode()


def _encode_worker(**flags) -> Worker:
    base = {"colocate-prefill": True, "remote-fraction": 0.0, "max-batch": 4, "threads": 1,
            "metrics-listen": f"127.0.0.1:{free_port()}"}
    return Worker(flags={**base, **flags})


@pytest.mark.skipif(not TWO_CORES, reason="the static split needs >= 2 allowed cores")
def test_static_policy_and_static_backend_serve_at_half(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    workers = (_encode_worker(**{"partition-policy": "static"}), _encode_worker(**{"sm-backend": "static"}))
    d = preset("colocated").with_model(model).with_gateway_ports(0, 0)
    d = d.with_flags("decode", max_seq_len=4096, num_slots=8, threads=1).with_flags("prefill", threads=1)
    d = dataclasses.replace(d, encode=workers)
    addrs = [dict(w.flags)["metrics-listen"] for w in workers]
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    try:
        stack.start(timeout=420)
        client = Client(stack.endpoints.grpc, timeout=120)
        for k in range(6):  # ties go round robin: both workers serve
            out = client.generate("hi", images=[png_bytes(40, 40, 200 + k)], max_tokens=3)
            assert out.finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
        for addr, policy in zip(addrs, ("static", "static")):
            info = json.loads(_get(addr, "/partition"))
            assert info["policy"] == policy and info["degraded"] == "", info
            assert info["last"] == {"encode_share": 0.5, "prefill_share": 0.5, "level_index": 0}, info
            assert info["requested"]["encode_share"] == 0.5
            spans = json.loads(_get(addr, "/trace?window_s=300"))["spans"]
            kinds = {s["kind"] for s in spans}
            assert kinds == {"encode", "prefill"}, kinds
            assert all(s["share"] == 0.5 for s in spans), spans
            m = _get(addr, "/metrics")
            n = metric(m, "easerve:encode_sm_share_count")
            assert n >= 1 and metric(m, "easerve:encode_sm_share_sum") == 0.5 * n
            assert metric(m, "easerve:encode_sm_partition_degraded") == 0.0
        backends = [json.loads(_get(a, "/partition"))["backend"] for a in addrs]
        assert backends == ["cpu_affinity", "static"]
    finally:
        stack.stop()


def _encode_cmd(model: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "services.encode", "--model", model, "--colocate-prefill", "--decode",
            f"127.0.0.1:{free_port()}", "--listen", "127.0.0.1:0", "--threads", "1", "--device", "cpu:0", *flags]


def test_one_core_named_backend_fails_the_start_auto_degrades_visibly(tiny_root, tmp_path):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run(_encode_cmd(model, "--sm-backend", "cpu_affinity"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "--sm-backend cpu_affinity is not available on cpu: only 1 allowed core: nothing to split" in bad.stderr
    metrics = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(_encode_cmd(model, "--metrics-listen", metrics), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "enc.log").open("w"))
    try:
        info = _wait_json(proc, metrics, "/partition", tmp_path / "enc.log")
        assert info["backend"] == "timeslice"
        assert info["degraded"].startswith("--sm-backend auto found no partition mechanism on cpu")
        assert metric(_get(metrics, "/metrics"), "easerve:encode_sm_partition_degraded") == 1.0
        assert "SM partition degraded: --sm-backend auto found no partition mechanism" in \
            (tmp_path / "enc.log").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_json(proc: subprocess.Popen, addr: str, path: str, log: Path, timeout: float = 300.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"encode exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return json.loads(_get(addr, path))
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"no {path} within {timeout} s: {log.read_text()[-2000:]}")
