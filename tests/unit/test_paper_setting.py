"""bench/paper_setting.py: the vLLM-like baseline encodes as vLLM v1's engine does (whatever is
waiting, up to the encoder budget of 2,048 rows, inside the engine step), and the table is run at
each stated encode overhead and 0; the overhead is fitted on one modality's ratios and scored on the
others' (bench/paper_fit.py), the roofline reported beside it."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from easerve.roofline import load_spec
from hasctl.roofline_profile import build
from hasctl.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("paper_setting", ROOT / "bench" / "paper_setting.py")
ps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ps)
from bench import paper_fit as pf  # noqa: E402  (importable once paper_setting put the root on sys.path)
GPUS = ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]


@pytest.mark.parametrize("modality, batch", [("image", 1), ("audio", 32)])
def test_vllm_like_takes_what_waits_up_to_the_encoder_budget(modality, batch):
    """LLaVA-NeXT's 672x672 image is 2,928 rows, over the 2,048 budget: one per step; a 10 s
    Ultravox clip is 63 rows: 2,048 // 63 = 32 per step. One monolith per tp2 pair."""
    model = str(ROOT / "bench" / "paper_models" / ps.MODELS[modality])
    prof = build(model, load_spec("rtx6000-ada"), tp=2)
    d = ps.vllm_like(model, GPUS, prof, WorkloadSpec(modality=modality, **ps.WORKLOAD), tp=2)
    assert not d.encode and not d.prefill and not d.decode
    assert [(w.device, w.tp, w.flag("batch-mode"), w.flag("max-batch")) for w in d.monolith] == \
        [(g, 2, "continuous", batch) for g in GPUS]


def test_the_table_runs_at_each_overhead_plus_the_roofline(tmp_path, capsys):
    """One modality: the table runs at 0 (added) and each value given, one profile each; no fold
    (nothing to hold out), so nothing is fitted and the top-level keys are the roofline's."""
    argv = ["--modalities", "audio", "--encode-overhead-s", "0.3", "--trials", "2", "--requests", "20",
            "--rates", "2,8", "--min-duration-s", "0", "--tune-rate-multiples", "1", "--refine", "1",
            "--out-dir", str(tmp_path), "--no-save"]
    assert ps.main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    worst = {x: v["paper_ratio_rel_err_max"] for x, v in last["by_overhead"].items()}
    assert set(worst) == {"0", "0.3"}
    assert last["held_out"] is None and last["folds"] == [] and last["fitted_encode_call_overhead_s"] is None
    assert last["encode_call_overhead_s"] == 0.0 and last["paper_ratio_rel_err_max"] == worst["0"]
    assert last["roofline_only"]["paper_ratio_rel_err_max"] == worst["0"]
    assert last["roofline_only"]["log_err_mean"] == last["by_overhead"]["0"]["log_err_mean"]["audio"]
    assert all(c.startswith("audio/") for c in last["at_ladder_top"])
    assert last["encode_kernel_share"]["audio"] == 1.0  # overhead 0: an encode call is all tower
    profiles = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("roofline-audio-*.json")}
    assert {n: p["roofline"]["encode_call_overhead_s"] for n, p in profiles.items()} == \
        {"roofline-audio-0s.json": 0.0, "roofline-audio-0.3s.json": 0.3}
    with pytest.raises(SystemExit):
        ps.main(["--encode-overhead-s", "-1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        ps.main(["--modalities", "video,audio", "--out-dir", str(tmp_path)])  # --fit-on image: not run


# ---- the held-out fit (bench/paper_fit.py), on a made-up table of ratios ---------------------
GRID = [0.0, 0.2, 0.4]
# mean |log(ours / paper)| of each modality's two ratios at each overhead
ERR = {"image": {0.0: 0.3, 0.2: 0.1, 0.4: 0.2},
       "video": {0.0: 0.5, 0.2: 0.4, 0.4: 0.0},
       "audio": {0.0: 0.1, 0.2: 0.6, 0.4: 0.05}}


def fake_table(err=ERR, paper=ps.PAPER):
    """Ratios off the paper's by the stated errors: vLLM's over by 1.5 e, Dynamo's under by 0.5 e
    (mean of the two: e; the signs differ so |log| is what is averaged)."""
    want = pf.paper_ratios(paper)
    return {(m, x): {"vllm": want[m]["vllm"] * math.exp(1.5 * e), "dynamo": want[m]["dynamo"] * math.exp(-0.5 * e)}
            for m, by_x in err.items() for x, e in by_x.items()}


def test_each_fold_fits_on_its_modality_alone_and_scores_the_others():
    fs = pf.folds(fake_table(), ps.PAPER, ["image", "video", "audio"], GRID)
    got = [(f["fit_on"], f["overhead_s"], f["held_out"]) for f in fs]
    assert got == [("image", 0.2, ["video", "audio"]), ("video", 0.4, ["image", "audio"]),
                   ("audio", 0.4, ["image", "video"])]
    for f, in_sample, held in zip(fs, (0.1, 0.0, 0.05), ((0.4 + 0.6) / 2, (0.2 + 0.05) / 2, (0.2 + 0.0) / 2)):
        assert f["in_sample_log_err_mean"] == pytest.approx(in_sample, abs=1e-12)
        assert f["held_out_log_err_mean"] == pytest.approx(held, abs=1e-12)
    assert fs[0]["ratios"]["video"] == fake_table()[("video", 0.2)]


def test_the_held_out_ratios_play_no_part_in_the_choice():
    """On all six ratios 0.4 fits best (mean 0.083 vs 0.3 and 0.367); fitted on image alone it is
    0.2, and the image fold's held-out error is 0.5 at 0.2 (0.025 had it peeked at 0.4)."""
    table = fake_table()
    everyone = pf.choose(table, ps.PAPER, ["image", "video", "audio"], GRID)
    assert everyone == 0.4
    fs, head = pf.held_out_report(table, ps.PAPER, ["image", "video", "audio"], GRID, "image")
    assert (head["fit_on"], head["overhead_s"], head["held_out_log_err_mean"]) == ("image", 0.2, 0.5)
    assert head["in_sample_log_err_mean"] == 0.1
    assert head["folds_held_out_log_err_mean"] == round((0.5 + 0.125 + 0.1) / 3, 3)
    # whatever the held-out modalities' ratios, the image fold chooses the same value
    for other in ({0.0: 0.0, 0.2: 2.0, 0.4: 2.0}, {0.0: 3.0, 0.2: 3.0, 0.4: 0.0}):
        poisoned = fake_table({**ERR, "video": other, "audio": other})
        assert pf.fold(poisoned, ps.PAPER, "image", ["image", "video", "audio"], GRID)["overhead_s"] == 0.2


def test_ties_go_to_the_smaller_overhead_and_a_missing_ratio_never_fits():
    table = fake_table({"image": {0.0: 0.2, 0.2: 0.2, 0.4: 0.2}, "audio": {0.0: 0.1, 0.2: 0.1, 0.4: 0.1}})
    assert pf.choose(table, ps.PAPER, ["image"], GRID) == 0.0
    table[("image", 0.0)]["vllm"] = None  # the baseline's goodput was 0
    assert pf.choose(table, ps.PAPER, ["image"], GRID) == 0.2
    fs, head = pf.held_out_report(table, ps.PAPER, ["image", "audio"], GRID, "audio")
    assert fs[1]["overhead_s"] == 0.0 and head["held_out_log_err_mean"] is None  # image at 0: infinite
    assert pf.folds(table, ps.PAPER, ["image"], GRID) == []


def test_main_reports_the_roofline_the_folds_and_the_headline_simulating_each_overhead_once(monkeypatch, tmp_path,
                                                                                         capsys):
    table = fake_table()
    calls = []

    def fake(args, dev, x):
        calls.append(x)
        out = {k: {m: table[(m, x)][b] for m in args.modalities}
               for k, b in (("easerve_over_vllm", "vllm"), ("easerve_over_dynamo", "dynamo"))}
        return {**out, "goodput": {}, "tune_rate": {}, "encode_kernel_share": {}, "at_ladder_top": []}, [], \
            {f"{m}/b": x for m in args.modalities}

    monkeypatch.setattr(ps, "table", fake)
    assert ps.main(["--encode-overhead-s", "0.2,0.4", "--out-dir", str(tmp_path), "--no-save"]) == 0
    assert calls == GRID
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(last)[:3] == ["held_out", "roofline_only", "folds"]  # the README quotes the first figures
    assert list(last["held_out"])[:3] == ["held_out_log_err_mean", "fit_on", "overhead_s"]
    assert (last["held_out"]["fit_on"], last["held_out"]["overhead_s"], last["held_out"]["held_out_log_err_mean"]) \
        == ("image", 0.2, 0.5)
    assert last["fitted_encode_call_overhead_s"] == last["encode_call_overhead_s"] == 0.2
    assert last["easerve_over_vllm"] == {m: table[(m, 0.2)]["vllm"] for m in ("image", "video", "audio")}
    assert last["roofline_only"]["log_err_mean"] == 0.3  # (0.3 + 0.5 + 0.1) / 3 at 0
    assert [(f["fit_on"], f["overhead_s"]) for f in last["folds"]] == [("image", 0.2), ("video", 0.4), ("audio", 0.4)]
    assert ps.main(["--fit-on", "video", "--out-dir", str(tmp_path), "--no-save"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["held_out"]["overhead_s"] == 0.4


def test_a_cell_lasts_long_enough_to_reach_steady_state():
    """At a high rate a fixed count of requests is a burst over before the decodes pile up: a
    cell runs `--requests`, or `--min-duration-s` of arrivals if that is more."""
    args = ps.args_of([])
    assert (args.requests, args.min_duration_s) == (200, 60.0)
    assert ps.cell_requests(args, 1.0) == 200 and ps.cell_requests(args, 32.0) == 1920
    assert ps.cell_requests(ps.args_of(["--quick"]), 16.0) == 320


def test_refinement_probes_both_gaps_next_to_the_best_rung():
    assert ps.refine_rates([1, 2, 4, 8], 2, 3) == [1.25, 1.5, 1.75, 2.5, 3.0, 3.5]
    assert ps.refine_rates([1, 2, 4], 1, 1) == [1.5]  # the bottom rung has one neighbour
    assert ps.refine_rates([1, 2, 4], 4, 0) == []


def test_easerve_is_the_best_deployment_tuned_at_each_rate_each_simulated_once(monkeypatch, tmp_path):
    """HAS tunes at each multiple of the baselines' peak; a deployment found at two rates is
    simulated once, and the best one's goodput is EAServe's."""
    model = str(ROOT / "bench" / "paper_models" / ps.MODELS["audio"])
    prof = build(model, load_spec("rtx6000-ada"), tp=2)
    w = WorkloadSpec(modality="audio", **ps.WORKLOAD)
    a, b = (ps.vllm_like(model, g, prof, w, tp=2) for g in (GPUS, GPUS[:2]))
    by_rate = {2.0: a, 3.0: b, 4.0: a, 6.0: b}
    monkeypatch.setattr(ps, "tune", lambda args, m, model, path, devices, rate, study: by_rate[rate])
    simulated = []
    monkeypatch.setattr(ps, "goodput", lambda d, *_: simulated.append(d) or ((5.0, 5.0) if d is b else (4.0, 4.0)))
    args = ps.args_of(["--out-dir", str(tmp_path)])
    assert ps.tuned_goodput(args, "audio", model, prof, tmp_path, w, GPUS, 2.0, "s") == (3.0, (5.0, 5.0))
    assert simulated == [a, b]
