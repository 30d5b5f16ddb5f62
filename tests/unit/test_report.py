"""hasctl report renders valid PNGs and a table with one row per run from bench result files."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from easerve.stages.encode.trace import UtilizationTrace
from hasctl.bench import BenchConfig, BenchResult
from hasctl.cli import main
from easerve.slo import SLO, RequestRecord, compute_metrics


def result_file(tmp_path, label: str, rate: float, ttft: float) -> str:
    recs = [RequestRecord(i, "image", i / rate, i / rate, [i / rate + ttft + 0.01 * k for k in range(5)],
                          i / rate + ttft + 0.05, 5, 10) for i in range(20)]
    slo = SLO(ttft_ms=150, tpot_ms=20)
    cfg = BenchConfig(url="http://127.0.0.1:1", rate=rate, num_requests=20, slo=slo, label=label)
    path = tmp_path / f"{label}-{rate:g}.json"
    path.write_text(BenchResult(cfg, "m", compute_metrics(recs, slo), recs).to_json())
    return str(path)


def trace_file(tmp_path) -> str:
    tr = UtilizationTrace()
    for k in range(20):
        tr.record("encode", 100 + k * 0.5, 100 + k * 0.5 + 0.3, share=0.6, batch=4)
        tr.record("prefill", 100 + k * 0.5 + 0.1, 100 + k * 0.5 + 0.2, share=0.4)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"now": 110.0, "buckets": tr.buckets(100.0, 110.0, 0.25)}))
    return str(path)


# matplotlib's first five cycle colours: one per plotted series, in drawing order
SERIES_RGB = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))
# a series drawn with no data still shows its legend sample: at most ~130 pixels of its colour
DRAWN_PIXELS = 300


def series_pixels(path) -> list[int]:
    """Pixels of each series colour in a rendered plot."""
    with Image.open(path) as im:
        rgb = np.asarray(im.convert("RGB")).astype(int)
    return [int((np.abs(rgb - c).sum(axis=2) < 40).sum()) for c in SERIES_RGB]


def test_report_renders_pngs_and_a_table(tmp_path, capsys):
    files = [result_file(tmp_path, "default", r, 0.1 + r / 100) for r in (2.0, 4.0)]  # distinct CDFs
    files += [result_file(tmp_path, "colocated", r, 0.2 + r / 100) for r in (2.0, 4.0, 8.0)]
    out = tmp_path / "rep"
    assert main(["report", *files, "--trace", trace_file(tmp_path), "--out", str(out)]) == 0
    # series drawn: goodput (2 deployments), CDFs (5 runs), utilization (encode, prefill)
    for name, series in (("goodput_vs_rate.png", 2), ("latency_cdf.png", 5), ("encode_utilization.png", 2)):
        with Image.open(out / name) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 300
        px = series_pixels(out / name)
        assert all(n > DRAWN_PIXELS for n in px[:series]) and not any(px[series:]), (name, px)
    md = (out / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "deployment" not in line]
    assert len(rows) == 5
    assert sum(r.startswith("| colocated | 8.00 |") for r in rows) == 1
    # default meets the 150 ms TTFT limit (goodput = throughput), colocated (200 ms) meets none
    default_2 = next(r for r in rows if r.startswith("| default | 2.00 |")).split(" | ")
    assert default_2[5] == default_2[4] and float(default_2[6]) == 1.0
    assert next(r for r in rows if r.startswith("| colocated | 2.00 |")).split(" | ")[5] == "0"
    assert "![goodput](goodput_vs_rate.png)" in md and "encode_utilization.png" in md
    assert str(out / "report.md") in capsys.readouterr().out


def test_report_rejects_files_that_are_not_results(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"format": "easerve.profile/v1"}')
    with pytest.raises(ValueError, match="not a hasctl bench result"):
        from hasctl.report import write_report
        write_report([str(bad)], tmp_path / "o")
    assert main(["report", str(bad), "--out", str(tmp_path / "o")]) == 2
