"""`hasctl tune` end to end on the tiny checkpoint: 3 real trials (each a launched stack, a
warm-up and the same seeded bench), the best deployment file it writes is served by `hasctl up`,
and a SIGINT in the middle of a trial leaves no process or port behind while a rerun continues
the same study (same seed, the interrupted point tried again)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment
from hasctl.trials import INTERRUPTED

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMALL = ["--rate", "2", "--requests", "3", "--warmup", "1", "--image-size", "48x40", "--input-tokens", "6",
         "--output-tokens", "3", "--ttft-ms", "60000", "--tpot-ms", "60000"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "EASERVE_LOG_LEVEL": "WARNING"}


def tune(model: str, storage: str, run_dir: Path, *extra: str, **popen) -> subprocess.Popen:
    argv = [sys.executable, "-m", "hasctl.cli", "tune", "--model", model, "--storage", storage, "--study", "t",
            "--run-dir", str(run_dir), *SMALL, *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(),
                            cwd=str(REPO), **popen)


def tagged(run_dir: Path) -> list[int]:
    """Live processes started for trials under run_dir (their environment names it)."""
    mark = f"EASERVE_TUNE_RUN={run_dir.resolve()}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes()
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in env.split(b"\0") and state != "Z":
            out.append(int(p.name))
    return out


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def tuned(tiny_root, tmp_path_factory):
    """A 3-trial study and the best deployment file it wrote."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    tmp = tmp_path_factory.mktemp("tune")
    storage, best = f"sqlite:///{tmp}/tune.db", tmp / "best.yaml"
    proc = tune(model, storage, tmp / "run", "--trials", "3", "--seed", "3", "--out", str(best))
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    return {"model": model, "storage": storage, "best": best, "out": out, "tmp": tmp}


def test_three_trials_scored_and_recorded(tuned):
    study = optuna.load_study(study_name="t", storage=tuned["storage"])
    trials = [t for t in study.get_trials() if t.state != TrialState.WAITING]  # warm starts past 3 wait
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state == TrialState.COMPLETE for t in trials)
    for t in trials:
        m = t.user_attrs["metrics"]
        assert m["completed"] == 3 and m["failed"] == 0, m
        assert t.value == pytest.approx(m["request_goodput"]) and t.value > 0  # the loose SLO is met
        json.dumps(m, allow_nan=False)
        d = Deployment.from_dict(t.user_attrs["deployment"])
        assert d.model == tuned["model"] and {w.device for w in d.workers()} <= {"cpu:0", "cpu:1", "cpu:0-1"}
    last = json.loads(tuned["out"].strip().splitlines()[-1])
    assert last["best_trial"] == study.best_trial.number and last["request_goodput"] == study.best_value
    assert not tagged(tuned["tmp"] / "run")


def test_best_file_is_served_by_hasctl_up(tuned):
    best = Deployment.load(tuned["best"])
    assert best.to_dict() | {"name": "", "gateway": None} == \
        Deployment.from_dict(optuna.load_study(study_name="t", storage=tuned["storage"]).best_trial
                             .user_attrs["deployment"]).to_dict() | {"name": "", "gateway": None}
    serve_and_ask(tuned["best"], tuned["model"], tuned["tmp"] / "up")


def serve_and_ask(deployment: Path, model: str, run_dir: Path) -> None:
    """`hasctl up --deployment` serves the file: one chat request is answered."""
    proc = subprocess.Popen([sys.executable, "-m", "hasctl.cli", "up", "--deployment", str(deployment),
                             "--http-port", "0", "--grpc-port", "0", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=str(REPO))
    try:
        url, seen = None, []
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"OpenAI HTTP : (\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(seen)
        body = {"model": Path(model).name, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hello there"}]}
        req = urllib.request.Request(f"{url}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_a_deployment_tuned_in_the_simulator_is_served_by_hasctl_up(tiny_root, tmp_path):
    """`hasctl tune --evaluator sim` over this machine's two cores (every trial simulated from a
    profile, nothing launched) writes a deployment file that `hasctl up` serves."""
    from hasctl.cli import main
    from easerve.profile_format import dump
    from tests.support.profiles import make_profile
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    prof = dump(make_profile(devices=("cpu:0", "cpu:1")), tmp_path / "p.json")
    best, storage = tmp_path / "best.yaml", f"sqlite:///{tmp_path / 'tune.db'}"
    assert main(["tune", "--model", model, "--rate", "2", "--trials", "4", "--storage", storage, "--study", "s",
                 "--evaluator", "sim", "--profile", str(prof), "--slo", "moderate", "--devices", "cpu:0,cpu:1",
                 "--requests", "40", "--out", str(best)]) == 0
    trials = [t for t in optuna.load_study(study_name="s", storage=storage).trials if t.state != TrialState.WAITING]
    assert len(trials) == 4 and all(t.user_attrs["evaluator"] == "sim" for t in trials)
    assert {w.device for w in Deployment.load(best).workers()} <= {"cpu:0", "cpu:1", "cpu:0-1"}
    serve_and_ask(best, model, tmp_path / "up")


def test_best_file_is_consumed_by_compose(tuned, tmp_path):
    import yaml

    from hasctl.cli import main
    from hasctl.deployment import process_names
    best = Deployment.load(tuned["best"])
    out = tmp_path / "compose.yaml"
    assert main(["compose", "--deployment", str(tuned["best"]), "--out", str(out)]) == 0
    services = yaml.safe_load(out.read_text())["services"]
    assert set(services) == set(process_names(best)) - {"gateway-http"}
    for stage in ("encode", "prefill", "decode", "monolith"):
        for i, w in enumerate(getattr(best, stage)):
            assert services[f"{stage}-{i}"]["cpuset"] == w.device.removeprefix("cpu:")


@pytest.mark.load  # ~40 s of live trials
def test_sigint_leaves_nothing_and_a_rerun_continues(tuned):
    run_dir = tuned["tmp"] / "run-int"
    proc = tune(tuned["model"], tuned["storage"], run_dir, "--trials", "2")
    lines, port = [], None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"trial 3: up, gateway http://127.0.0.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
        assert time.monotonic() < deadline, "".join(lines)
    assert port, "".join(lines)
    assert "3 trials so far (1 queued), seed 3;" in "".join(lines)  # stored seed: no --seed; the 4th warm start waits
    live = tagged(run_dir)
    assert len(live) >= 2, live  # the trial's stage processes and gateway
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(lines) + rest
    assert not tagged(run_dir) and not [p for p in live if Path(f"/proc/{p}").exists()]
    assert port_free(port)

    study = optuna.load_study(study_name="t", storage=tuned["storage"])
    t3 = study.get_trials()[3]
    assert t3.state == TrialState.FAIL and t3.user_attrs["error"] == INTERRUPTED

    again = tune(tuned["model"], tuned["storage"], tuned["tmp"] / "run-again", "--trials", "1")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    trials = optuna.load_study(study_name="t", storage=tuned["storage"]).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert trials[4].state == TrialState.COMPLETE and trials[4].params == t3.params
    assert trials[4].user_attrs["retry_of"] == 3
    assert not tagged(tuned["tmp"] / "run-again")


def test_a_stack_that_cannot_start_fails_its_trial_with_the_reason(tmp_path, capsys):
    from hasctl.cli import main
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    storage = f"sqlite:///{tmp_path}/tune.db"
    rc = main(["tune", "--model", str(empty), "--storage", storage, "--study", "f", "--trials", "1",
               "--run-dir", str(tmp_path / "run"), "--startup-timeout", "120", *SMALL])
    assert rc == 1 and "no trial completed" in capsys.readouterr().err
    trials = optuna.load_study(study_name="f", storage=storage).get_trials()
    t = trials[0]  # the first warm start (Dynamo-like, on E1-P1-D1); the others wait for a next run
    assert t.state == TrialState.FAIL and t.params["alloc"] == "E1-P1-D1"
    assert [x.state for x in trials[1:]] == [TrialState.WAITING] * 3  # Dynamo-like first, then the screen's, presets
    error = t.user_attrs["error"]  # whichever process exits first: a stage or the gateway
    assert re.match(r"did not start: (\w+-0|gateway) exited with code \d+ while starting", error), error
    assert not tagged(tmp_path / "run")
