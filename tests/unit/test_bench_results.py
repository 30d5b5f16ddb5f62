"""bench/harness/results.py: the stored result of a bench names its command, commit, machine and
date beside the last-line JSON, and its plots lie beside it as PNG; --save defaults to on for a
full run and off for --quick."""
from __future__ import annotations

import argparse
import json
import os

from bench.harness import results
from bench.harness.load import Reply
from bench.harness.scoring import report_row


def test_save_result_writes_the_schema_and_the_plots(tmp_path):
    recs = [Reply(i, "image", 0.1 * i, sent_s=0.1 * i, chunk_s=[0.1 * i + 0.2, 0.1 * i + 0.25], end_s=0.1 * i + 0.3,
                  output_tokens=2) for i in range(4)]
    plots = results.report_plots([report_row("on", 1.0, recs, (300.0, 100.0))])
    path = results.save_result("demo", {"ratio": 1.5}, ["--rate", "2"], plots, out_dir=tmp_path)
    doc = json.loads(path.read_text())
    assert path == tmp_path / "result.json"
    assert list(doc) == ["bench", "command", "commit", "machine", "date", "result"]
    assert (doc["bench"], doc["command"], doc["result"]) == ("demo", "python bench/demo.py --rate 2", {"ratio": 1.5})
    assert doc["commit"] and len(doc["commit"].removesuffix("-dirty")) >= 7
    assert doc["machine"]["cores"] == len(os.sched_getaffinity(0)) and doc["machine"]["cpu"]
    assert set(doc["machine"]) == {"cpu", "cores", "gpu", "python", "torch"}
    assert doc["date"].endswith("+00:00")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["goodput_vs_rate.png", "latency_cdf.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.glob("*.png"))


def test_save_defaults_to_full_runs_only():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    results.add_save_flag(ap)
    assert [results.should_save(ap.parse_args(a)) for a in ([], ["--quick"], ["--quick", "--save"], ["--no-save"])] \
        == [True, False, True, False]


def test_a_partial_host_path_run_is_not_saved_unless_asked(monkeypatch, capsys):
    """`bench/host_path.py --skip ...` must not replace the stored full result with a partial one."""
    import bench.host_path as hp

    saved = []
    monkeypatch.setattr(hp, "checkpoint", lambda *a, **k: "/no/model")
    monkeypatch.setattr(results, "save_result", lambda *a, **k: saved.append(a) or results.RESULTS / "x.json")
    hp.main(["--skip", "framework,media,movement"])
    assert saved == [] and json.loads(capsys.readouterr().out.splitlines()[-1])["framework"] == {}
    hp.main(["--skip", "framework,media,movement", "--save"])
    assert len(saved) == 1
