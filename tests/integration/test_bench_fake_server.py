"""`hasctl bench` against a real fake OpenAI server process whose delays are known and recorded
on the server's own clock (tests/support/fake_openai.py).

Tolerances (client-side minus server-side, the gap being localhost transit and event-loop
wake-ups on a shared 2-core machine): TTFT within 15 ms on average and 100 ms for any one
request; TPOT within 2 ms on average and 10 ms for any one request. (On an idle machine the
gaps are about 1-2 ms and 0.2 ms; with every core saturated by other work, the TTFT gap
averaged 7 ms.) The goodput count equals the count from the server's truth, exactly unless a
request's true latency came within that tolerance of a limit (the limits, 120 ms / 20 ms, sit
70-80 ms and 10 ms from both classes, 50 ms / 10 ms and 200 ms / 30 ms, so only a starved
server makes any), and goodput = that count / the run's duration.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hasctl.cli import main
from hasctl.workload import WorkloadSpec, synthesize
from tests.support.fake_openai import request_class

ROOT = Path(__file__).resolve().parents[2]
N, TOKENS = 60, 10


@pytest.fixture()
def fake_server():
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_openai"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_bench_agrees_with_the_servers_own_count(fake_server, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["bench", "--url", fake_server, "--modality", "text", "--rate", "20", "--requests", str(N),
               "--input-tokens", "12", "--output-tokens", str(TOKENS), "--ttft-ms", "120", "--tpot-ms", "20",
               "--seed", "11", "--label", "fake", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    truth = {t["text"]: t for t in json.load(urllib.request.urlopen(fake_server + "/truth"))}
    texts = [r.messages[0]["content"][-1]["text"]
             for r in synthesize(WorkloadSpec(modality="text", input_tokens=12, output_tokens=TOKENS), N, 11)]
    assert len(truth) == N and set(truth) == set(texts)
    classes = [request_class(t) for t in texts]
    assert {"fast", "slow", "reject"} <= set(classes)  # the seed exercises every class

    recs = res["records"]
    d_ttft, d_tpot = [], []
    for r, text, kind in zip(recs, texts, classes):
        if kind == "reject":
            assert r["error_kind"] == "http_429"
            continue
        t = truth[text]
        assert r["error"] is None and r["output_tokens"] == TOKENS == len(r["chunk_s"])
        ttft = r["chunk_s"][0] - r["sent_s"]
        tpot = (r["chunk_s"][-1] - r["chunk_s"][0]) / (TOKENS - 1)
        d_ttft.append(ttft - t["ttft_s"])
        d_tpot.append(tpot - t["tpot_s"])
    assert sum(abs(x) for x in d_ttft) / len(d_ttft) < 0.015 and max(abs(x) for x in d_ttft) < 0.100
    assert sum(abs(x) for x in d_tpot) / len(d_tpot) < 0.002 and max(abs(x) for x in d_tpot) < 0.010

    served = [truth[t] for t, k in zip(texts, classes) if k != "reject"]
    good = sum(1 for t in served if t["ttft_s"] <= 0.120 and t["tpot_s"] <= 0.020)
    assert 0 < good < len(served)  # the SLO splits the served requests
    # a request whose true latency lies within the tolerance of a limit may fall either side
    borderline = sum(1 for t in served if abs(t["ttft_s"] - 0.120) < 0.015 or abs(t["tpot_s"] - 0.020) < 0.002)
    assert abs(res["slo_met"] - good) <= borderline
    assert res["request_goodput"] == pytest.approx(res["slo_met"] / res["duration"])
    assert res["slo_attainment"] == pytest.approx(res["slo_met"] / N)
    rejected = classes.count("reject")
    assert res["completed"] == N - rejected and res["errors_by_kind"] == {"http_429": rejected}
    assert res["model_id"] == "fake-model" and res["label"] == "fake" and res["request_rate"] == 20
    # vLLM-named fields are present and consistent with the records
    for key in ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "request_throughput",
                "output_throughput", "request_goodput", "mean_e2el_ms"):
        assert res[key] is not None, key
    assert res["output_throughput"] == pytest.approx(res["completed"] * TOKENS / res["duration"])
    assert res["max_send_lag_ms"] < 250  # open loop: sends kept their schedule (closed loop: seconds late)
    assert 0 < res["client_cpu_s"] < 0.5 * res["duration"]  # a light client: well under one core


@pytest.mark.slow
def test_the_hard_timeout_cancels_open_requests_and_counts_them(fake_server, tmp_path, capsys):
    import asyncio

    from hasctl.bench import BenchConfig, run_bench
    cfg = BenchConfig(url=fake_server, rate=50.0, num_requests=20, seed=11, timeout_s=0.25, progress=True,
                      workload=WorkloadSpec(modality="text", input_tokens=12, output_tokens=40))
    res = asyncio.run(run_bench(cfg))
    # 40 tokens at >= 10 ms each cannot end within 0.25 s: sent requests are cut, later ones never sent
    assert any(r.error_kind == "run_timeout" and r.sent_s is not None for r in res.records)
    assert any(r.error_kind == "run_timeout" and r.sent_s is None for r in res.records)
    assert "no_tokens" not in res.metrics["errors_by_kind"]
    assert res.metrics["completed"] + res.metrics["failed"] == len(res.records) <= 20
    assert "bench 50 req/s" in capsys.readouterr().err  # the progress bar is on stderr


@pytest.mark.slow
def test_dataset_replay_sends_each_line_once(fake_server, tmp_path):
    prompts = [f"replayed prompt number {k}" for k in range(7)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 3 + k % 2}) for k, p in enumerate(prompts)))
    out = tmp_path / "r.json"
    assert main(["bench", "--url", fake_server + "/v1", "--dataset", str(data), "--rate", "30", "--no-progress",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    truth = json.load(urllib.request.urlopen(fake_server + "/truth"))
    assert sorted(t["text"] for t in truth) == sorted(prompts)
    ok = [k for k, p in enumerate(prompts) if request_class(p) != "reject"]
    assert res["num_prompts"] == 7 and res["completed"] == len(ok)
    assert [res["output_lens"][k] for k in ok] == [3 + k % 2 for k in ok]  # each line's own max_tokens
    assert all(res["ttfts"][k] > 0.04 for k in ok) and len(res["itls"]) == 7 and res["modality"] == "dataset"


@pytest.mark.slow
def test_max_concurrency_keeps_at_most_n_in_flight_on_the_server(fake_server):
    """--max-concurrency 3 at a rate far above what 3 can serve: a closed loop of 3 (server's clock)."""
    import asyncio

    from hasctl.bench import BenchConfig, run_bench
    cfg = BenchConfig(url=fake_server, rate=1000.0, num_requests=15, seed=5, progress=False, max_concurrency=3,
                      workload=WorkloadSpec(modality="text", input_tokens=12, output_tokens=4))
    res = asyncio.run(run_bench(cfg))
    truth = json.load(urllib.request.urlopen(fake_server + "/truth"))
    assert len(truth) == 15 and res.metrics["completed"] + res.metrics["failed"] == 15
    events = sorted([(t["recv_s"], 1) for t in truth] + [(t["end_s"], -1) for t in truth], key=lambda e: (e[0], e[1]))
    open_now, most = 0, 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    assert most == 3
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchConfig(url=fake_server, max_concurrency=0)
