"""bench/sim_fidelity.py's scoring (bench/fidelity_score.py) and its --resim of a run folder."""
from __future__ import annotations

import json
import math

import pytest

from bench import fidelity_score as fs
from bench import sim_fidelity
from easerve.profile_format import dump
from easerve.slo import SLO, RequestRecord
from hasctl.bench import BenchConfig
from hasctl.simulate import run_simulation
from hasctl.workload import WorkloadSpec
from tests.support.profiles import make_profile

SLO_1S = SLO(1000.0, 100.0)


def rec(i: int, at: float, ttft: float, ok: bool = True) -> RequestRecord:
    if not ok:
        return RequestRecord(i, "image", at, at, [], None, error="busy", error_kind="http_429")
    return RequestRecord(i, "image", at, at, [at + ttft, at + ttft + 0.01], at + ttft + 0.01, 2)


def test_goodput_counts_the_steady_window_only():
    """Arrivals 0..9 s: the first and last 15 % of the span (1.35 s each) are dropped, so 2..7
    count; of those, the two with a 2 s TTFT miss the 1 s tier: goodput = rate x 4 / 6."""
    recs = [rec(i, float(i), 2.0 if i in (3, 4, 0, 9) else 0.1) for i in range(10)]
    assert fs.window(recs) == pytest.approx((1.35, 7.65))
    assert fs.steady_outcomes(recs, SLO_1S) == [True, False, False, True, True, True]
    assert fs.steady_goodput(recs, SLO_1S, rate=3.0) == pytest.approx(2.0)


def test_capacity_is_completions_per_second_in_the_steady_window():
    """40 arrivals over 0..39 s; only those that ended inside [5.85, 33.15] count."""
    recs = [rec(i, float(i), 0.5) for i in range(40)]
    recs += [rec(40 + i, float(i), 0.5, ok=False) for i in range(40)]  # refused: not completions
    ends_inside = sum(5.85 <= r.end_s <= 33.15 for r in recs if r.ok)
    assert fs.steady_capacity(recs) == pytest.approx(ends_inside / (33.15 - 5.85))


def test_the_interval_carries_the_noise_between_repeats():
    same = [[True] * 8 + [False] * 2] * 3
    mean, lo, hi = fs.interval(same, rate=2.0)
    assert mean == pytest.approx(1.6) and lo < mean < hi      # within-run resampling alone
    apart = [[True] * 10, [True] * 5 + [False] * 5, [True] * 8 + [False] * 2]
    m2, lo2, hi2 = fs.interval(apart, rate=2.0)
    assert m2 == pytest.approx(2.0 * (1.0 + 0.5 + 0.8) / 3)
    assert hi2 - lo2 > hi - lo                                # runs that disagree widen it
    assert fs.interval([[True] * 10], rate=2.0) == (2.0, 2.0, 2.0)


def test_a_cell_is_inside_the_widened_interval_or_its_excess_says_how_far():
    assert fs.score_cell(1.04, 1.0, 0.9, 1.0) == {"inside": True, "bias": round(math.log(1.04), 4), "excess": 0.0}
    out = fs.score_cell(2.0, 1.0, 0.9, 1.0)
    assert not out["inside"] and out["bias"] == round(math.log(2.0), 4)
    assert out["excess"] == round(math.log(2.0 / 1.05), 4)
    low = fs.score_cell(0.5, 1.0, 0.9, 1.0)
    assert not low["inside"] and low["excess"] == round(math.log(0.9 * 0.95 / 0.5), 4)


def test_live_against_live_scores_each_repeat_against_the_others():
    same = [[True] * 9 + [False]] * 3
    scored = fs.leave_one_out(same, rate=1.0)
    assert len(scored) == 3 and all(s["inside"] and s["bias"] == 0.0 for s in scored)
    # the odd run out is outside the others' interval; each of the two alike lies inside an
    # interval that the odd one widens to [0, 1]
    odd = fs.leave_one_out([[True] * 10, [True] * 10, [False] * 10], rate=1.0)
    assert [s["inside"] for s in odd] == [True, True, False]


def test_rank_agreement_counts_only_pairs_the_live_intervals_separate():
    cells = {"a": {"lo": 1.0, "hi": 1.2, "mean": 1.1, "sim": 1.5},
             "b": {"lo": 2.0, "hi": 2.2, "mean": 2.1, "sim": 1.4},    # apart from a: counted, sim order wrong
             "c": {"lo": 1.1, "hi": 2.1, "mean": 1.6, "sim": 9.0}}    # overlaps both: never counted
    assert fs.rank_separable(cells, "sim") == (0, 1)
    cells["b"]["sim"] = 3.0
    assert fs.rank_separable(cells, "sim") == (1, 1)


def test_a_miss_is_attributed_to_the_first_part_that_misses():
    assert fs.attribute({"encode": 0.05}, 0.1, 0.9) == "none"
    assert fs.attribute({"encode": 0.3, "decode": 0.05}, 0.5, 0.5) == "service time (encode 0.30)"
    assert fs.attribute({"encode": 0.05}, 0.4, 0.5) == "queueing (replay TTFT p50 error 0.40)"
    assert fs.attribute({"encode": 0.05}, 0.1, 0.5) == "policy"


def test_resim_of_the_simulators_own_run_scores_no_error(tmp_path, capsys):
    """A run folder whose 'live' files are the simulator's own runs (same host work, same
    residual delay): capacity bias 0, every cell inside, bias 0."""
    prof = make_profile()
    dump(prof, tmp_path / "profile.json")
    slo = prof.slo("moderate")
    host = {"default": {"host_s": {"gateway": 0.002, "encode": 0.003, "prefill": 0.001, "decode": 0.004}},
            "monolith": {"host_s": {"gateway": 0.002, "monolith": 0.006}}}
    meta = {"image": {"model": "/m", "profile": str(tmp_path / "profile.json"), "host": host,
                      "slo": slo.to_dict(), "deployments": ["default", "monolith"]}}
    ctx = {"profile": prof, "modality": "image", "host": host}
    spec = WorkloadSpec(image_size=(224, 224), output_tokens=6)
    state = {"image": {}}
    for name in ("default", "monolith"):
        d = sim_fidelity.deployment(name)
        mc = sim_fidelity.model_config(sim_fidelity.host_s_of(d, ctx), 0.01)
        run_dir = tmp_path / "image" / name
        run_dir.mkdir(parents=True)

        def write(file: str, rate: float, n: int, seed: int) -> dict:
            cfg = BenchConfig(url="http://simulated.invalid", rate=rate, num_requests=n, seed=seed, workload=spec,
                              ignore_eos=True, slo=slo, label=name, progress=False)
            bench, run = run_simulation(d, prof, cfg, mc)
            (run_dir / file).write_text(bench.to_json())
            return run.phases_ms
        write("capacity.json", 40.0, 200, 7)
        cells = {}
        for j, load in enumerate(("0.5", "0.8")):
            cells[load] = []
            for k in range(2):
                phases = write(f"live-r{k}-{load}.json", 2.0 + 2 * j, 60, j)
                cells[load].append({"file": f"live-r{k}-{load}.json", "steal": 0.0, "flagged": False,
                                    "phases_ms": phases})
        state["image"][name] = {"overhead_s": 0.01, "live_capacity": fs.steady_capacity(
            [RequestRecord.from_dict(r) for r in json.loads((run_dir / "capacity.json").read_text())["records"]]),
            "cells": cells, "blocks": []}
    (tmp_path / "run.json").write_text(json.dumps({"args": {}, "state": state, "meta": meta}))
    assert sim_fidelity.main(["--resim", str(tmp_path), "--no-save"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["capacity_bias_max"] == 0.0 and last["coverage"] == 1.0 and last["bias_median"] == 0.0
    assert set(last["capacity_bias"]) == {"image/default", "image/monolith"}
    assert last["live_vs_live"]["coverage"] == 1.0
    phases = {"queue", "encode", "prefill", "ttft"}  # preprocess: 0 ms in a profile without gateway points
    assert set(last["phase_bias"]) == phases and set(last["phase_bias"].values()) == {0.0}
    assert (tmp_path / "image" / "default" / "sim-0.5.json").is_file() and (tmp_path / "fidelity.md").is_file()
