"""The encode control plane on a live stack: the co-located path runs under the live SM
backend (and says which and why), the deficit router holds s, the metrics and the
utilization trace show batches, dispatch reasons, shares and both workers' busy time."""
from __future__ import annotations

import json
import os
import urllib.request

import pytest

from easerve import Client
from tests.support.media import png_bytes
from tests.support.prom import metric

pytestmark = pytest.mark.slow


def _get(stack, path: str) -> str:
    argv = next(p.cmd.argv for n, p in stack._procs.items() if n == "encode-0")
    addr = argv[argv.index("--metrics-listen") + 1]
    return urllib.request.urlopen(f"http://{addr}{path}", timeout=10).read().decode()


def test_colocated_encode_reports_backend_routes_at_s_and_traces(vl_stack):
    client = Client(vl_stack.endpoints.grpc, timeout=120)
    before = _get(vl_stack, "/metrics")
    for k in range(6):
        client.generate("hi", images=[png_bytes(40, 40, 100 + k)], max_tokens=2)
    after = _get(vl_stack, "/metrics")
    local = metric(after, "easerve:encode_routed_total", route="local") - \
        metric(before, "easerve:encode_routed_total", route="local")
    remote = metric(after, "easerve:encode_routed_total", route="remote") - \
        metric(before, "easerve:encode_routed_total", route="remote")
    assert local + remote == 6 and abs(remote - 3) <= 1  # s = 0.5, within one request
    assert metric(after, "easerve:encode_remote_fraction_target") == 0.5
    assert metric(after, "easerve:encode_dispatch_total") >= 1
    assert metric(after, "easerve:encode_batch_size_count") >= 1
    assert metric(after, "easerve:encode_sm_share_count") >= 1
    info = json.loads(_get(vl_stack, "/partition"))
    # the stack's processes inherit this affinity: with two cores or more, auto must split them
    want = "cpu_affinity" if len(os.sched_getaffinity(0)) >= 2 else "timeslice"
    assert info["backend"] == want and info["reason"], info
    if want == "cpu_affinity":  # a real split: some level leaves prefill cores of its own
        assert any(0 < r["encode_share"] < 1 and r["prefill_share"] > 0 for r in info["realized"]), info
    assert info["last"] is not None and 0 < info["last"]["encode_share"] <= 1
    trace = json.loads(_get(vl_stack, "/trace?window_s=120"))["buckets"]
    assert any(b.get("encode", 0) > 0 for b in trace) and any(b.get("prefill", 0) > 0 for b in trace)
