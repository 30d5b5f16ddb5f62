"""Tensor-parallel instances: the deployment file's `tp` key and the simulator's reading of it
(an instance with tp=k holds k GPUs and runs at the speed of the profile taken with tp=k)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from easerve.policy.service_model import ModelConfig
from easerve.sim.run import Sim
from hasctl.bench import BenchConfig
from hasctl.deployment import Deployment, Worker, preset, process_names, to_commands
from hasctl.simulate import run_simulation, topology
from hasctl.workload import WorkloadSpec
from tests.support.profiles import make_profile

ENC = {"max-batch": 8, "remote-fraction": 1.0, "batch-mode": "adaptive"}


def tp_profile(tp: int, decode_tok_s: float):
    return dataclasses.replace(make_profile(decode_tok_s=decode_tok_s), tp=tp)


def dep(decode_tp: int = 1, decode_device: str = "cuda:2", **kw) -> Deployment:
    return Deployment(model="m", encode=(Worker("cuda:0", flags=ENC),), prefill=(Worker("cuda:1"),),
                      decode=(Worker(decode_device, tp=decode_tp),), **kw)


# ---- the deployment file --------------------------------------------------------------------------
def test_tp_round_trips_through_yaml_and_is_left_out_at_one(tmp_path):
    d = dep(decode_tp=2)
    back = Deployment.load(d.dump(tmp_path / "d.yaml"))
    assert back.decode[0].tp == 2 and back == d
    assert "tp" not in back.to_dict()["encode"][0] and back.to_dict()["decode"][0]["tp"] == 2


@pytest.mark.parametrize("worker, match", [
    ({"device": "cuda:2", "tp": 0}, r"decode\[0\]\.tp must be an int >= 1"),
    ({"device": "cuda:2", "tp": "2"}, r"decode\[0\]\.tp must be an int >= 1"),
    ({"device": "cuda:2", "tp": True}, r"decode\[0\]\.tp must be an int >= 1"),
    ({"device": "cpu:0-3", "tp": 2}, r"decode\[0\]: tp 2 needs a device cuda:N .* set device to cuda:N or tp to 1"),
    ({"device": "cuda", "tp": 2}, r"needs a device cuda:N"),
    ({"device": "cuda:3", "tp": 2}, r"multiple of 2, got cuda:3; use cuda:2 or cuda:4"),
])
def test_bad_tp_names_what_to_change(tmp_path, worker, match):
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"prefill": [{"device": "cuda:0"}], "decode": [worker]}))
    with pytest.raises(ValueError, match=match):
        Deployment.load(f)


def test_groups_may_coincide_or_nest_but_not_overlap_in_part():
    Deployment(prefill=(Worker("cuda:0", tp=2),), decode=(Worker("cuda:0", tp=2),))  # sharing a group
    Deployment(prefill=(Worker("cuda:0", tp=4),), decode=(Worker("cuda:2", tp=2),))  # nested
    with pytest.raises(ValueError, match=r"prefill\[0\] \(GPUs \[0, 1, 2\]\) overlaps decode\[0\] \(GPUs \[2, 3\]\)"):
        Deployment(prefill=(Worker("cuda:0", tp=3),), decode=(Worker("cuda:2", tp=2),))


def test_launching_refuses_tp_above_one_and_says_where_it_is_honoured():
    d = dep(decode_tp=2)
    ports = {n: 9000 + i for i, n in enumerate(process_names(d))}
    with pytest.raises(ValueError, match=r"decode\[0\] \(tp 2\): the stage processes run on one device each.*set tp to 1"):
        to_commands(d, "127.0.0.1", ports)
    assert to_commands(dep(), "127.0.0.1", ports)  # tp 1 launches as before


def test_compose_and_k8s_refuse_tp_above_one_before_renumbering_gpus():
    from hasctl.compose import compose_dict
    from hasctl.k8s import manifests
    d = dep(decode_tp=4, decode_device="cuda:4")  # compose would renumber it cuda:2, a misaligned group
    for make in (compose_dict, manifests):
        with pytest.raises(ValueError, match=r"decode\[0\] \(tp 4\): the stage processes run on one device"):
            make(d)


# ---- the simulator --------------------------------------------------------------------------------
def run(d: Deployment, profile, extra=(), n=40, rate=0.5, per_host=8):
    cfg = BenchConfig(url="http://simulated.invalid", rate=rate, num_requests=n, seed=0,
                      workload=WorkloadSpec(modality="image", image_size=(224, 224), output_tokens=16),
                      ignore_eos=True, progress=False)
    bench, _ = run_simulation(d, profile, cfg, ModelConfig(per_host), extra)
    return bench.metrics


def test_a_tp_instance_runs_at_the_speed_of_the_profile_taken_with_that_tp():
    slow, fast = tp_profile(1, decode_tok_s=100.0), tp_profile(2, decode_tok_s=400.0)
    one = run(dep(decode_tp=1), slow, [fast])
    two = run(dep(decode_tp=2), slow, [fast])
    # a decode step of batch b takes b / decode_tok_s: 4x the tokens/s at every batch
    assert two["mean_tpot_ms"] == pytest.approx(one["mean_tpot_ms"] / 4, rel=0.15)
    # the main profile may be the tp-2 one; then tp-1 workers need a tp-1 profile beside it
    assert run(dep(decode_tp=2), fast, [slow])["mean_tpot_ms"] == pytest.approx(two["mean_tpot_ms"])


def test_a_tp_without_its_profile_says_which_profile_to_add():
    with pytest.raises(ValueError, match=r"decode-0 has tp=2 but no profile taken with tp=2 .*--tp-profile"):
        run(dep(decode_tp=2), tp_profile(1, 100.0))
    with pytest.raises(ValueError, match=r"two profiles were given for tp=1"):
        run(dep(), tp_profile(1, 100.0), [tp_profile(1, 200.0)])


def test_a_tp_instance_holds_every_gpu_of_its_group():
    d = Deployment(model="m", encode=(Worker("cuda:1", flags=ENC), Worker("cuda:2", flags=ENC)),
                   prefill=(Worker("cuda:3"),), decode=(Worker("cuda:0", tp=2),))
    sim = Sim(topology(d), tp_profile(1, 100.0), profiles=[tp_profile(2, 200.0)])
    dec = sim.decode[0].compute
    assert sim.encode[0].compute in dec.neighbours        # cuda:1 is the group's second GPU
    assert sim.encode[1].compute not in dec.neighbours    # cuda:2 is outside it
    assert dec in sim.encode[0].compute.neighbours


def test_a_tp_instance_holds_its_gpus_kv_memory():
    def blocks(tp: int) -> int:
        d = dep(decode_tp=tp)
        d = dataclasses.replace(d, decode=(dataclasses.replace(d.decode[0], flags={"max-seq-len": 64}),))
        t = dataclasses.replace(topology(d), gpu_kv_gb=0.01)  # a budget that binds: 327 tokens (5 slots) per GPU
        return Sim(t, tp_profile(1, 100.0), profiles=[tp_profile(2, 100.0)]).decode[0].sched.blocks.num_blocks
    assert blocks(2) == 2 * blocks(1) > 0


def test_a_tp_group_may_not_span_two_nodes():
    d = dep(decode_tp=4, decode_device="cuda:4")
    with pytest.raises(ValueError, match=r"decode-0 spans cuda:4..cuda:7, across nodes of 6 GPUs"):
        run(d, tp_profile(1, 100.0), [tp_profile(4, 100.0)], per_host=6)
    assert run(d, tp_profile(1, 100.0), [tp_profile(4, 100.0)], n=5)["completed"] == 5


def test_presets_simulate_unchanged_without_tp():
    m = run(preset("default").with_model("m"), tp_profile(1, 100.0), n=10)
    assert m["completed"] == 10


def test_hasctl_simulate_takes_a_profile_per_tp(tmp_path, capsys):
    from easerve import profile_format as pf
    from hasctl.cli import main
    one = pf.dump(tp_profile(1, 100.0), tmp_path / "tp1.json")
    two = pf.dump(tp_profile(2, 400.0), tmp_path / "tp2.json")
    dfile = dep(decode_tp=2).dump(tmp_path / "d.yaml")
    common = ["simulate", "--deployment", str(dfile), "--profile", str(one), "--rate", "0.5", "--requests", "20",
              "--modality", "image", "--image-size", "224x224", "--output-tokens", "16", "--ignore-eos"]
    assert main([*common, "--out", str(tmp_path / "no.json")]) == 2
    assert "no profile taken with tp=2" in capsys.readouterr().err
    assert main([*common, "--tp-profile", str(two), "--out", str(tmp_path / "sim.json")]) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["completed"] == 20 and doc["simulated"]["tp_profiles"] == [str(two)]
    assert doc["simulated"]["deployment"]["decode"][0]["tp"] == 2


def test_tune_gives_every_instance_the_profiles_tp():
    from hasctl.tune_space import Space, deployment_for, runnable_allocations
    space = Space(tuple(runnable_allocations(3)), ("cuda:0", "cuda:2", "cuda:4"), tp=2)
    d = deployment_for(space, {"alloc": "E1-P1-D1", "B": 8}, "m")
    assert [(w.device, w.tp) for w in d.workers()] == [("cuda:4", 2), ("cuda:2", 2), ("cuda:0", 2)]
    mono = deployment_for(space, {"alloc": "monolith", "B": 8}, "m")
    assert mono.monolith[0].tp == 2
    with pytest.raises(ValueError, match=r"devices \(cuda:1\): a tp 2 group must start .* use cuda:0 or cuda:2"):
        Space(tuple(runnable_allocations(2)), ("cuda:0", "cuda:1"), tp=2)


def test_tune_takes_a_tp_profile_in_the_simulator_only(tmp_path, capsys):
    from easerve import profile_format as pf
    from hasctl.cli import main
    prof = pf.dump(tp_profile(2, 400.0), tmp_path / "tp2.json")
    common = ["tune", "--profile", str(prof), "--slo", "moderate", "--rate", "1", "--modality", "image",
              "--devices", "cuda:0,cuda:2,cuda:4", "--trials", "2", "--requests", "10", "--model", "m",
              "--image-size", "224x224", "--storage", f"sqlite:///{tmp_path / 't.db'}", "--study", "s",
              "--out", str(tmp_path / "b.yaml")]
    assert main([*common, "--evaluator", "live"]) == 2
    assert "tp=2 profile" in capsys.readouterr().err and not (tmp_path / "b.yaml").exists()
    assert main([*common, "--evaluator", "sim", "--run-dir", str(tmp_path / "run")]) == 0
    best = Deployment.load(tmp_path / "b.yaml")
    assert {w.tp for w in best.workers()} == {2}
