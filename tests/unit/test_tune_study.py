"""hasctl.tune's trial bookkeeping on a real sqlite optuna storage: failed trials keep their
reason, a resumed study continues its numbering with its own seed, an interrupted trial is
queued again. The evaluation here is a pure function of the deployment (the launcher's part is
tested end to end in tests/integration/test_tune.py)."""
from __future__ import annotations

import pytest
from optuna.trial import TrialState

from easerve.slo import SLO
from hasctl.cli import main
from hasctl.deployment import Deployment
from hasctl.trials import INTERRUPTED, TrialFailed, TuneConfig, best_deployment, open_study, run_trials
from hasctl.tune_space import Space, runnable_allocations

SPACE = Space(tuple(runnable_allocations(3)), ("cpu:0", "cpu:1"))


def cfg(**kw) -> TuneConfig:
    return TuneConfig(**{"model": "/m", "rate": 2.0, "slo": SLO(1000, 100), **kw})


def fake_goodput(d: Deployment, number: int) -> dict:
    """Goodput = B of the encode / monolith worker; the co-located allocation 'fails to start'."""
    if d.encode and d.encode[0].flag("colocate-prefill"):
        raise TrialFailed(f"did not start: encode-0 exited with code 1 (trial {number})")
    w = (d.encode or d.monolith)[0]
    return {"request_goodput": float(w.flag("max-batch")), "completed": 4, "failed": 0, "p99_ttft_ms": float("nan"),
            "by_modality": {"image": (1, 2)}}


def open_(tmp_path, seed=None, c=None):
    c = c or cfg()
    return open_study(f"sqlite:///{tmp_path}/t.db", "s", seed, lambda s: c.fingerprint(SPACE) | {"seed": s})


def test_failed_start_is_recorded_with_its_reason_and_the_search_goes_on(tmp_path):
    study, seed = open_(tmp_path, seed=5)
    assert seed == 5
    run_trials(study, SPACE, cfg(seed=5), 12, fake_goodput, say=lambda m: None)
    trials = study.get_trials()
    assert len(trials) == 12
    failed = [t for t in trials if t.state == TrialState.FAIL]
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert failed and done, [t.params for t in trials]
    for t in failed:
        assert t.params["alloc"] == "E1-P1-D1+coloc"
        assert t.user_attrs["error"] == f"did not start: encode-0 exited with code 1 (trial {t.number})"
    for t in done:
        assert t.value == t.params.get("B", 1)  # request_at_a_time draws no B: it runs max-batch 1
        m = t.user_attrs["metrics"]
        assert m["p99_ttft_ms"] is None and m["by_modality"] == {"image": [1, 2]}  # JSON-safe
        assert Deployment.from_dict(t.user_attrs["deployment"]).name == f"s-t{t.number}"
    best = best_deployment(study)
    top = max(done, key=lambda t: (t.value, -t.number))
    assert best.name == f"tuned-s-t{top.number}" and (best.gateway.grpc_port, best.gateway.http_port) == (50051, 8000)
    assert (best.encode or best.monolith)[0].flag("max-batch") == top.params.get("B", 1)
    assert (best.encode or best.monolith)[0].flag("batch-mode") == top.params["mode"]


def test_resume_continues_numbering_with_the_stored_seed(tmp_path):
    study, _ = open_(tmp_path, seed=7)
    run_trials(study, SPACE, cfg(seed=7), 3, fake_goodput, say=lambda m: None)
    again, seed = open_(tmp_path)  # no --seed: the study's
    assert seed == 7
    run_trials(again, SPACE, cfg(seed=7), 2, fake_goodput, say=lambda m: None)
    assert [t.number for t in again.get_trials()] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="made with --seed 7"):
        open_(tmp_path, seed=8)
    with pytest.raises(ValueError, match="other settings \\(rate\\)"):
        open_(tmp_path, c=cfg(rate=3.0))


def test_same_seed_same_search(tmp_path):
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        study, _ = open_(tmp_path / name, seed=1)
        run_trials(study, SPACE, cfg(seed=1), 8, fake_goodput, say=lambda m: None)
        runs.append([t.params for t in study.get_trials()])
    assert runs[0] == runs[1]


def test_interrupted_trial_is_failed_and_queued_for_the_next_run(tmp_path):
    study, _ = open_(tmp_path)
    calls = []

    def interrupted(d, number):
        calls.append(number)
        if number == 1:
            raise KeyboardInterrupt
        return fake_goodput(d, number) if not d.encode or not d.encode[0].flag("colocate-prefill") else \
            {"request_goodput": 0.5}

    with pytest.raises(KeyboardInterrupt):
        run_trials(study, SPACE, cfg(), 5, interrupted, say=lambda m: None)
    assert calls == [0, 1]
    t1 = study.get_trials()[1]
    assert t1.state == TrialState.FAIL and t1.user_attrs["error"] == INTERRUPTED
    again, _ = open_(tmp_path)
    run_trials(again, SPACE, cfg(), 1, interrupted, say=lambda m: None)
    t2 = again.get_trials()[2]
    assert t2.state == TrialState.COMPLETE and t2.params == t1.params and t2.user_attrs["retry_of"] == 1


def test_a_trial_left_running_by_a_killed_run_is_failed_on_reopen(tmp_path):
    study, _ = open_(tmp_path)
    study.ask()  # the run "died" here
    again, _ = open_(tmp_path)
    (t,) = again.get_trials()
    assert t.state == TrialState.FAIL and "killed" in t.user_attrs["error"]


def test_cli_needs_an_slo(tmp_path, capsys):
    rc = main(["tune", "--model", str(tmp_path), "--rate", "1", "--storage", f"sqlite:///{tmp_path}/t.db",
               "--study", "x", "--cores", "0"])
    assert rc == 2 and "goodput needs an SLO" in capsys.readouterr().err
    rc = main(["tune", "--model", str(tmp_path), "--rate", "1", "--storage", f"sqlite:///{tmp_path}/t.db",
               "--study", "x", "--cores", "zero", "--ttft-ms", "1", "--tpot-ms", "1"])
    assert rc == 2 and "--cores must be" in capsys.readouterr().err


def test_profile_screens_out_allocations_encode_cannot_carry(tmp_path):
    from hasctl.cli import build_parser
    from easerve.profile_format import dump
    from hasctl.tune import space_from_args
    from tests.support.profiles import make_profile
    # encode 10 images/s per instance, 15 req/s of one image each: only E2 allocations carry it
    prof = dump(make_profile(), tmp_path / "p.json")
    args = build_parser().parse_args(["tune", "--model", "/m", "--rate", "15", "--storage", "sqlite://", "--study",
                                      "x", "--profile", str(prof), "--cores", "0-3", "--instances", "4"])
    said = []
    space = space_from_args(args, say=said.append)
    assert space.choices == ("E2-P1-D1", "E2-P1-D1+coloc", "monolith")
    assert space.devices == ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    assert any(m.startswith("screened out E1-P1-D1: encode: capacity 10 items/s < demand 15") for m in said), said
    assert said[-1].startswith(f"screening with {prof}: 2 of 8 allocations kept")


def test_trials_share_one_partition_profile_per_device_and_backend(tmp_path):
    from hasctl.trials import shared_partition_profiles
    from hasctl.tune_space import MONOLITH, deployment_for
    a = deployment_for(SPACE, {"alloc": "E1-P1-D1+coloc", "B": 4, "s": 0.5}, "/m")
    b = deployment_for(SPACE, {"alloc": "E1-P1-D1+coloc", "B": 16, "s": 0.1}, "/m")
    c = deployment_for(SPACE, {"alloc": "E1-P1-D1", "B": 4}, "/m")
    m = deployment_for(SPACE, {"alloc": MONOLITH, "B": 4}, "/m")
    pa, pb = (shared_partition_profiles(d, tmp_path).encode[0].flag("partition-profile") for d in (a, b))
    assert pa == pb and pa.startswith(str(tmp_path)) and pa.endswith(".json")  # same device, backend: one file
    assert shared_partition_profiles(c, tmp_path).encode[0].flag("partition-profile") is None  # nothing shared
    pm = shared_partition_profiles(m, tmp_path).monolith[0].flag("partition-profile")
    assert pm is not None and pm != pa
    assert a.encode[0].flag("partition-profile") is None  # the trial's own deployment is left as drawn


def test_a_new_study_tries_the_presets_points_first_and_a_resumed_one_does_not_again(tmp_path):
    from hasctl.tune_space import warm_starts
    warm = warm_starts(SPACE)
    # the Dynamo-like baseline (request-at-a-time encode, remote prefill), then the presets' points
    assert warm[0] == {"alloc": "E1-P1-D1", "mode": "request_at_a_time"}
    warm = warm[1:]
    assert [p["alloc"] for p in warm] == ["E1-P1-D1", "E1-P1-D1+coloc", "monolith"]
    assert all(p["B"] == 8 for p in warm)

    def opened():
        return open_study(f"sqlite:///{tmp_path}/w.db", "w", 3, lambda s: cfg().fingerprint(SPACE) | {"seed": s},
                          warm=warm)
    study, _ = opened()
    run_trials(study, SPACE, cfg(seed=3), 4, fake_goodput, say=lambda m: None)
    trials = study.get_trials()
    assert [t.params for t in trials[:3]] == warm
    assert [t.user_attrs.get("warm_start") for t in trials] == [True, True, True, None]
    again, _ = opened()
    run_trials(again, SPACE, cfg(seed=3), 2, fake_goodput, say=lambda m: None)
    assert not any(t.user_attrs.get("warm_start") for t in again.get_trials()[4:])
    # the colocated preset's point fails to start here (fake_goodput) and is recorded like any trial
    assert trials[1].state == TrialState.FAIL and trials[0].value == 8.0
