"""compute_metrics on hand-made records: every field follows from the definitions."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hasctl.bench import BenchConfig
from easerve.slo import SLO, RequestRecord, compute_metrics


def rec(i, sent, chunks, end, tokens=None, modality="image", error=None, kind=None):
    return RequestRecord(i, modality, scheduled_s=sent, sent_s=sent, chunk_s=list(chunks), end_s=end,
                         output_tokens=tokens, prompt_tokens=10, error=error, error_kind=kind)


RECORDS = [
    rec(0, 0.0, [0.1, 0.12, 0.14, 0.16, 0.18], 0.19),          # ttft 100, tpot 20
    rec(1, 0.5, [0.8, 0.9, 1.0], 1.0, tokens=3),               # ttft 300, tpot 100
    rec(2, 1.0, [1.05], 1.06, modality="text"),                # one token: ttft 50, no tpot
    rec(3, 1.5, [], 1.6, error="HTTP 429: full", kind="http_429"),
    rec(4, 2.0, [2.2, 2.21, 2.22], 4.0, tokens=5),             # usage says 5 tokens: tpot 20/4 = 5
]


def test_fields_follow_the_definitions():
    m = compute_metrics(RECORDS, SLO(ttft_ms=250, tpot_ms=50))
    assert m["duration"] == pytest.approx(4.0)
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_output_tokens"] == 5 + 3 + 1 + 5 and m["total_input_tokens"] == 40
    assert m["request_throughput"] == pytest.approx(4 / 4.0)
    assert m["output_throughput"] == pytest.approx(14 / 4.0)
    ttfts = [100, 300, 50, 200]
    assert m["mean_ttft_ms"] == pytest.approx(np.mean(ttfts))
    assert m["median_ttft_ms"] == pytest.approx(150) == pytest.approx(m["p50_ttft_ms"])
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert m["mean_tpot_ms"] == pytest.approx(np.mean([20, 100, 5]))
    itls = [20, 20, 20, 20, 100, 100, 10, 10]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p90_itl_ms"] == pytest.approx(np.percentile(itls, 90))
    assert m["mean_e2el_ms"] == pytest.approx(np.mean([190, 500, 60, 2000]))
    # met: r0 (100 <= 250, 20 <= 50), r2 (50, one token), r4 (200, 5); not r1 (300 ms TTFT) nor r3 (failed)
    assert m["slo_met"] == 3 and m["request_goodput"] == pytest.approx(3 / 4.0)
    assert m["slo_attainment"] == pytest.approx(3 / 5)
    assert m["errors_by_kind"] == {"http_429": 1}
    assert m["by_modality"]["text"]["completed"] == 1 and m["by_modality"]["image"]["requests"] == 4
    assert m["by_modality"]["image"]["slo_attainment"] == pytest.approx(2 / 4)


def test_per_modality_limits_and_no_slo():
    slo = SLO(ttft_ms=250, tpot_ms=50, by_modality=(("text", 40.0, 50.0),))
    assert compute_metrics(RECORDS, slo)["slo_met"] == 2  # text's 50 ms TTFT misses its 40 ms limit
    m = compute_metrics(RECORDS)
    assert m["request_goodput"] is None and m["slo_attainment"] is None
    json.dumps(m, allow_nan=False)  # the result file is strict JSON


def test_empty_series_are_none_not_nan():
    m = compute_metrics([rec(0, 0.0, [], 1.0, error="x", kind="connection")], SLO(1, 1))
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    assert m["request_goodput"] == 0 and m["errors_by_kind"] == {"connection": 1}
    with pytest.raises(ValueError, match="no requests"):
        compute_metrics([])


def test_record_round_trips_and_validation():
    r = RECORDS[4]
    assert RequestRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="ms > 0"):
        SLO(0, 10)
    with pytest.raises(ValueError, match="exactly one of num_requests"):
        BenchConfig(url="http://x", num_requests=None)
    with pytest.raises(ValueError, match="http://"):
        BenchConfig(url="localhost:8000")
    assert BenchConfig(url="http://h:1/v1").endpoint == "http://h:1/v1/chat/completions"
    assert BenchConfig(url="http://h:1/").endpoint == "http://h:1/v1/chat/completions"


def test_cli_errors_say_what_to_change(tmp_path, capsys):
    from hasctl.cli import main
    from hasctl.launch import free_port
    base = ["bench", "--url", f"http://127.0.0.1:{free_port()}", "--rate", "1", "--requests", "1",
            "--no-progress", "--out", str(tmp_path / "r.json")]
    assert main(base) == 2
    assert "is the server up at --url?" in capsys.readouterr().err
    assert main(base + ["--slo", "tight"]) == 2
    assert "add --profile PROFILE.json" in capsys.readouterr().err
    assert main(base + ["--ttft-ms", "100"]) == 2
    assert "--ttft-ms and --tpot-ms go together" in capsys.readouterr().err
    assert main(base + ["--burstiness", "0"]) == 2
    assert "burstiness K must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
