"""`hasctl bench` against EAServe's own OpenAI API on a live stack (image, video and text in
one mixed run), then `hasctl report` over its result and the encode service's /trace."""
from __future__ import annotations

import json
import urllib.request

import pytest
from PIL import Image

from hasctl.cli import main

pytestmark = pytest.mark.slow


def _get(stack, path: str) -> str:
    """GET from the encode service's metrics listener (--metrics-listen of encode-0)."""
    argv = next(p.cmd.argv for n, p in stack._procs.items() if n == "encode-0")
    addr = argv[argv.index("--metrics-listen") + 1]
    return urllib.request.urlopen(f"http://{addr}{path}", timeout=10).read().decode()


def test_bench_mixed_on_the_live_stack_and_report(vl_stack, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "--url", vl_stack.endpoints.openai_base_url, "--modality", "mixed",
                 "--mix", "image,video,text", "--rate", "2", "--requests", "9", "--image-size", "48x40",
                 "--video-frames", "2", "--video-size", "32x32", "--input-tokens", "6", "--output-tokens", "3",
                 "--ignore-eos", "--ttft-ms", "60000", "--tpot-ms", "60000", "--seed", "4", "--label", "colocated",
                 "--no-progress", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["failed"] == 0, [r["error"] for r in res["records"] if r.get("error")]
    assert res["completed"] == 9 and res["total_output_tokens"] == 27  # usage: 3 tokens each (EOS ignored)
    assert set(res["by_modality"]) == {"image", "video", "text"}
    assert res["slo_attainment"] == 1.0 and res["request_goodput"] == pytest.approx(9 / res["duration"])
    assert all(r["prompt_tokens"] > 6 for r in res["records"])  # chat template and media placeholders
    assert res["median_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0

    trace = tmp_path / "trace.json"
    trace.write_text(_get(vl_stack, "/trace?window_s=120"))
    rep = tmp_path / "rep"
    assert main(["report", str(out), "--trace", str(trace), "--out", str(rep)]) == 0
    for name in ("goodput_vs_rate.png", "latency_cdf.png", "encode_utilization.png"):
        with Image.open(rep / name) as im:
            im.verify()
    assert "| colocated | 2.00 | 9 | 0 |" in (rep / "report.md").read_text()


def test_bench_audio_on_the_live_stack(audio_stack, tmp_path):
    out = tmp_path / "a.json"
    assert main(["bench", "--url", audio_stack.endpoints.http, "--modality", "audio", "--audio-s", "0.5",
                 "--rate", "2", "--requests", "3", "--output-tokens", "2", "--ignore-eos", "--no-progress",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["failed"] == 0 and res["total_output_tokens"] == 6
    assert res["request_goodput"] is None  # no SLO given: no goodput claimed
