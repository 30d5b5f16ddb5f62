"""`hasctl profile --roofline --network-gbps N`: the link between nodes, as the simulator reads it
(a prefill on one node handing its KV to a decode on another pays bytes / (N / 8) GB/s)."""
from pathlib import Path

import pytest

from easerve.roofline import load_spec
from easerve.policy.service_model import ModelConfig
from easerve import profile_format as pf
from hasctl.bench import BenchConfig
from hasctl.cli import main
from hasctl.deployment import Deployment, Worker
from hasctl.roofline_profile import NETWORK_LATENCY_S, build
from hasctl.simulate import run_simulation
from hasctl.workload import WorkloadSpec

MODEL = str(Path(__file__).resolve().parents[2] / "bench" / "paper_models" / "ultravox-27b")


def test_network_gbps_writes_the_other_host_link(tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--roofline", "--gpu", "h100-sxm", "--network-gbps", "100", "--model", MODEL,
                 "--out", str(out)]) == 0
    link = pf.load(out).link("other_host")
    assert (link.gb_per_s, link.latency_s, link.measured) == (12.5, NETWORK_LATENCY_S, False)
    assert build(MODEL, load_spec("h100-sxm")).link("other_host") is None   # not stated: none
    with pytest.raises(ValueError, match="--network-gbps must be > 0"):
        build(MODEL, load_spec("h100-sxm"), network_gbps=0)
    assert main(["profile", "--network-gbps", "100", "--model", MODEL, "--out", str(out)]) == 2  # measured: refused


def test_a_decode_on_another_node_waits_for_its_kv_over_the_network():
    spec = load_spec("h100-sxm")
    slow, fast = build(MODEL, spec, network_gbps=10), build(MODEL, spec, network_gbps=400)
    enc = {"max-batch": 8, "remote-fraction": 1.0}

    def tpot_ms(prof, decode_gpu: int) -> float:
        d = Deployment(model=MODEL, encode=(Worker("cuda:0", flags=enc),), prefill=(Worker("cuda:1"),),
                       decode=(Worker(f"cuda:{decode_gpu}"),))
        cfg = BenchConfig(url="http://simulated.invalid", rate=0.2, num_requests=10, seed=0, ignore_eos=True,
                          workload=WorkloadSpec(modality="audio", audio_s=10.0, input_tokens=32, output_tokens=9),
                          progress=False)
        return run_simulation(d, prof, cfg, ModelConfig(8))[0].metrics["mean_tpot_ms"]

    same = tpot_ms(slow, 2)
    assert tpot_ms(fast, 2) == pytest.approx(same)   # one node: the network plays no part
    # the KV of a request's prompt crosses once, between its token 1 and token 2 (8 gaps)
    prompt = 32 + 16 + slow.unloaded_for("audio").prompt_tokens - 48
    crossing_ms = (prompt * slow.transfer.kv_bytes_per_token / (10 / 8 * 1e9) + NETWORK_LATENCY_S) * 1e3
    assert tpot_ms(slow, 8) - same == pytest.approx(crossing_ms / 8, rel=0.05)
    assert tpot_ms(fast, 8) - same == pytest.approx(crossing_ms / 8 / 40, rel=0.2, abs=0.05)
