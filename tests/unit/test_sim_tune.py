"""`hasctl simulate` and `hasctl tune --evaluator sim` from the command line."""
from __future__ import annotations

import json

import optuna
import pytest

from easerve.slo import RequestRecord, compute_metrics
from hasctl.cli import main
from hasctl.deployment import Deployment
from easerve.profile_format import dump
from tests.support.profiles import make_profile

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
    # each trial ran 60 s of arrivals (--sim-min-duration-s' default): 180 requests at 3 req/s, not --requests' 60
    assert all(t.user_attrs["metrics"]["completed"] + t.user_attrs["metrics"]["failed"] == 180 for t in done)


def test_a_simulated_trial_runs_at_least_its_min_duration_of_arrivals(tmp_path):
    """--requests is a floor, and so is --sim-min-duration-s x rate: at a high rate a fixed
    count is a burst that ends before the queues build (the profile's deployment then scores
    a rate it cannot sustain)."""
    from hasctl.cli import build_parser
    from hasctl.deployment import preset
    from hasctl.trials import evaluate_sim
    from hasctl.tune import config_from_args

    prof = make_profile()
    path = dump(prof, tmp_path / "p.json")
    base = ["tune", "--model", str(tmp_path), "--rate", "8", "--storage", "sqlite://", "--study", "s",
            "--evaluator", "sim", "--profile", str(path), "--slo", "moderate", "--devices", DEVICES, "--requests", "20"]
    cfg = lambda *extra: config_from_args(build_parser(["tune"]).parse_args([*base, *extra]), str(tmp_path))  # noqa: E731
    assert cfg().sim_requests == 480 and cfg("--sim-min-duration-s", "0").sim_requests == 20
    assert cfg("--sim-min-duration-s", "1").sim_requests == 20  # 8 arrivals: --requests is the floor
    burst, steady = (evaluate_sim(preset("colocated").with_model(str(tmp_path)), cfg(*x), prof)
                     for x in (("--sim-min-duration-s", "0"), ("--sim-min-duration-s", "20")))
    assert burst["completed"] + burst["failed"] == 20 and steady["completed"] + steady["failed"] == 160
    # past this deployment's capacity (about 6 req/s here): the 2.5 s burst still meets the SLO
    # for a quarter of its requests, 20 s of arrivals for a few percent
    assert steady["request_goodput"] < 0.5 * burst["request_goodput"], (burst, steady)
    with pytest.raises(ValueError, match="--sim-min-duration-s must be >= 0"):
        cfg("--sim-min-duration-s", "-1")


def test_prescreen_measures_only_the_top_k_simulated_candidates_live(tmp_path):
    """`--evaluator live --prescreen sim:K`: the simulator ranks --trials candidates and only
    the K best distinct ones reach the live evaluator (a fake here: nothing is launched)."""
    from hasctl import tune
    from hasctl.cli import build_parser

    prof = dump(make_profile(), tmp_path / "p.json")
    common = ["--model", str(tmp_path), "--rate", "3", "--trials", "8", "--profile", str(prof), "--slo", "moderate",
              "--devices", DEVICES, "--requests", "40", "--seed", "5"]
    # the same search scored in the simulator alone: its K best distinct points are the expected live ones
    sim_storage = f"sqlite:///{tmp_path / 'sim.db'}"
    assert main(["tune", *common, "--storage", sim_storage, "--study", "s", "--evaluator", "sim"]) == 0
    sim_trials = sorted((t for t in optuna.load_study(study_name="s", storage=sim_storage).trials
                         if t.value is not None), key=lambda t: (-t.value, t.number))
    expected, seen = [], set()
    for t in sim_trials:
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            expected.append((t.params, t.value))
    k = 3
    assert len(expected) > k  # else "only the top K" would not be tested

    launched = []

    def fake_live(d, cfg, run_dir, on_up=lambda s: None):
        assert cfg.evaluator == "live"
        launched.append(d.to_dict())
        return {"request_goodput": 0.5 + len(launched), "completed": cfg.num_requests, "failed": 0}

    storage = f"sqlite:///{tmp_path / 'live.db'}"
    args = build_parser(["tune"]).parse_args(["tune", *common, "--storage", storage, "--study", "l",
                                              "--evaluator", "live", "--prescreen", f"sim:{k}",
                                              "--run-dir", str(tmp_path / "runs")])
    assert tune.run(args, evaluate_live=fake_live) == 0
    study = optuna.load_study(study_name="l", storage=storage)
    assert len(launched) == k and len(study.trials) == k
    assert [t.params for t in study.trials] == [p for p, _ in expected[:k]]
    assert [t.user_attrs["deployment"] for t in study.trials] == launched
    for t, (_, sim_value) in zip(study.trials, expected):
        assert t.user_attrs["evaluator"] == "live"
        assert t.user_attrs["prescreen_sim_goodput"] == sim_value
        assert t.value == t.user_attrs["metrics"]["request_goodput"]  # scored by the live evaluator


def test_a_sim_search_ends_at_least_as_good_as_the_baselines_it_can_express(tmp_path):
    """EAServe must not lose to a deployment it could have chosen: the vLLM-like layout (a
    monolith on each GPU, data parallel) and the Dynamo-like one (request-at-a-time encode, every
    prefill remote, at each E/P/D split) are points of the space; a search of as many trials as
    its warm starts ends at a deployment at least as good as each, here the data-parallel
    monolith (the test profile lists no interference, so four monoliths run four GPUs' worth)."""
    from hasctl.cli import build_parser
    from hasctl.deployment import PRESETS, Worker
    from hasctl.trials import TrialFailed, evaluate_sim
    from hasctl.tune import config_from_args
    from hasctl.tune_space import Space, deployment_for, runnable_allocations, warm_starts

    prof = make_profile()
    path = dump(prof, tmp_path / "p.json")
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    argv = ["tune", "--model", str(tmp_path), "--rate", "12", "--storage", storage, "--study", "s",
            "--evaluator", "sim", "--profile", str(path), "--slo", "moderate", "--devices", DEVICES,
            "--requests", "60", "--sim-min-duration-s", "0", "--out", str(tmp_path / "best.yaml")]
    args = build_parser(["tune"]).parse_args(argv)
    from hasctl.tune import space_from_args
    n_warm = len(warm_starts(space_from_args(args, say=lambda m: None)))
    assert main([*argv, "--trials", str(n_warm)]) == 0
    best = max(t.value for t in optuna.load_study(study_name="s", storage=storage).trials if t.value is not None)

    cfg = config_from_args(args, str(tmp_path))
    vllm = Deployment(name="vllm-like", model=cfg.model, prefill=(), decode=(),
                      monolith=tuple(Worker(device=d, flags=dict(PRESETS["monolith"].monolith[0].flags))
                                     for d in DEVICES.split(","))).with_gateway_ports(0, 0)
    space = Space(tuple(a for a in runnable_allocations(4) if not a.colocated), tuple(DEVICES.split(",")))
    dynamo = [deployment_for(space, {"alloc": a.name, "mode": "request_at_a_time"}, cfg.model)
              for a in space.allocations]

    def goodput(d):
        try:
            return evaluate_sim(d, cfg, prof)["request_goodput"]
        except TrialFailed:
            return 0.0
    baselines = {"vllm": goodput(vllm), "dynamo": max(goodput(d) for d in dynamo)}
    assert baselines["vllm"] > baselines["dynamo"] > 0  # the monolith per GPU is the one to match here
    assert best >= max(baselines.values()) - 1e-9, (best, baselines)
    chosen = Deployment.load(tmp_path / "best.yaml")
    assert len(chosen.monolith) == 4 and [w.device for w in chosen.monolith] == DEVICES.split(",")
