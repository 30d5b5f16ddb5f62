"""bench/sim_fidelity.py --resim: a finished run folder's cells re-simulated on the BenchConfig
each live cell recorded. A folder whose "live" cells are the simulator's own runs scores 0."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hasctl.bench import BenchConfig
from hasctl.deployment import preset
from easerve.profile_format import dump
from hasctl.simulate import run_simulation
from hasctl.workload import WorkloadSpec
from tests.profiles import make_profile

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sim_fidelity", ROOT / "bench" / "sim_fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)


def test_resim_of_the_simulators_own_cells_scores_zero_and_rewrites_the_sim_files(tmp_path, capsys):
    prof = make_profile()
    dump(prof, tmp_path / "profile-qwen2.5-vl-bench.json")
    for name in ("default", "dynamo-like"):
        run_dir = tmp_path / "image" / name
        run_dir.mkdir(parents=True)
        for rate in (2.0, 6.0):
            # a seed, size and SLO of their own: --resim must take them from the cell, not its defaults
            config = BenchConfig(url="http://simulated.invalid", rate=rate, num_requests=12, seed=7,
                                 workload=WorkloadSpec(image_size=(224, 224), output_tokens=6), ignore_eos=True,
                                 slo=prof.slo("tight"), label=name, progress=False)
            (run_dir / f"live-{rate:g}.json").write_text(run_simulation(preset(name), prof, config)[0].to_json())
    assert fidelity.main(["--resim", str(tmp_path), "--no-save"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["goodput_rel_err_median"] == 0.0 and last["goodput_rel_err_max"] == 0.0
    assert last["ttft_p50_rel_err_median"] == 0.0 and last["rank_agreement"] in (1.0, None)
    assert set(last["by_deployment"]) == {"default", "dynamo-like"}
    assert sorted(last["cells"]) == ["image/default@2", "image/default@6", "image/dynamo-like@2",
                                     "image/dynamo-like@6"]
    sim = json.loads((tmp_path / "image" / "default" / "sim-6.json").read_text())
    assert sim["endpoint"] == "simulated" and sim["config"]["seed"] == 7 and sim["completed"] == 12
    assert (tmp_path / "fidelity.md").is_file() and (tmp_path / "fidelity.json").is_file()


def test_the_second_live_run_of_each_cell_is_scored_against_the_first_as_the_noise_floor():
    def c(live_good, again_good, ttft, again_ttft, sim_good=1.0):
        live = {"request_goodput": live_good, "median_ttft_ms": ttft}
        again = {"request_goodput": again_good, "median_ttft_ms": again_ttft}
        return fidelity.cell(1.0, live, {"request_goodput": sim_good, "median_ttft_ms": ttft}, again)
    # two deployments at one rate: the 2nd run swaps their order and moves goodput 25 % and 50 %
    cells = {"image": {5.0: {"a": c(2.0, 1.5, 400.0, 500.0), "b": c(1.0, 1.5, 300.0, 300.0)}}}
    out = fidelity.summarize(cells)
    floor = out["live_vs_live"]
    assert floor["cells"] == 2
    assert floor["goodput_rel_err_median"] == 0.375 and floor["goodput_rel_err_max"] == 0.5
    assert floor["ttft_p50_rel_err_median"] == 0.125
    assert floor["rank_agreement"] is None            # the 2nd run ties them: no order to agree on
    cells["image"][5.0]["b"] = c(1.0, 1.6, 300.0, 300.0)
    assert fidelity.summarize(cells)["live_vs_live"]["rank_agreement"] == -1.0
    assert out["goodput_rel_err_max"] == 0.5          # the simulator is still scored against the 1st run
    assert fidelity.summarize({"image": {5.0: {"a": fidelity.cell(1.0, {}, {})}}})["live_vs_live"] is None
