"""`hasctl simulate` and `hasctl tune --evaluator sim` from the command line."""
from __future__ import annotations

import json

import optuna

from hasctl.bench_metrics import RequestRecord, compute_metrics
from hasctl.cli import main
from hasctl.deployment import Deployment
from hasctl.profile_format import dump
from tests.profiles import make_profile

DEVICES = "cuda:0,cuda:1,cuda:2,cuda:3"


def test_simulate_writes_bench_fields_and_trace(tmp_path, capsys):
    prof = dump(make_profile(), tmp_path / "p.json")
    out = tmp_path / "sim.json"
    args = ["simulate", "--profile", str(prof), "--preset", "colocated", "--rate", "5", "--requests", "50",
            "--modality", "mixed", "--mix", "image,text", "--slo", "loose", "--seed", "3", "--out", str(out)]
    assert main(args) == 0
    assert "simulated seconds per wall second" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["format"] == "easerve.bench/v1" and doc["endpoint"] == "simulated" and doc["label"] == "colocated"
    assert doc["num_prompts"] == 50 and doc["completed"] + doc["failed"] == 50
    assert {r["modality"] for r in doc["records"]} == {"image", "text"}
    records = [RequestRecord.from_dict(r) for r in doc["records"]]
    assert compute_metrics(records)["completed"] == doc["completed"]
    trace = json.loads((tmp_path / "sim.trace.json").read_text())
    assert set(trace["encode-0"]) == {"now", "buckets", "spans"}
    assert {s["kind"] for s in trace["encode-0"]["spans"]} == {"encode", "prefill"}
    first = out.read_text()
    assert main(args) == 0  # same seed, same result
    assert json.loads(out.read_text())["records"] == json.loads(first)["records"]


def test_tune_with_the_simulator_writes_a_deployment(tmp_path):
    prof = dump(make_profile(), tmp_path / "p.json")
    out = tmp_path / "best.yaml"
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    assert main(["tune", "--model", str(tmp_path), "--rate", "3", "--trials", "6", "--storage", storage,
                 "--study", "s", "--evaluator", "sim", "--profile", str(prof), "--slo", "moderate",
                 "--devices", DEVICES, "--requests", "60", "--out", str(out)]) == 0
    d = Deployment.load(out)
    assert d.decode or d.monolith
    study = optuna.load_study(study_name="s", storage=storage)
    done = [t for t in study.trials if t.value is not None]
    assert len(study.trials) == 6 and done and all(t.user_attrs["evaluator"] == "sim" for t in study.trials)
    assert all(t.user_attrs["metrics"]["completed"] + t.user_attrs["metrics"]["failed"] == 60 for t in done)
