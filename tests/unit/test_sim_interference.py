"""Workers that share CPU cores slow each other down in the simulator (processor sharing) unless
the profile measured the pair; on a GPU an unmeasured pair does not interfere."""
from __future__ import annotations

import dataclasses
import statistics

from easerve.sim import simulate
from easerve.sim.run import Sim
from hasctl.profile_format import Interference
from tests.profiles import make_profile
from tests.unit.sim_helpers import poisson, topo


def computes(device: str, profile=None):
    sim = Sim(topo(device=device), profile or make_profile())
    return sim.encoders[0].compute, sim.remote_prefills[0].compute, sim.decoders[0].compute


def test_busy_workers_on_shared_cores_share_them():
    enc, pre, dec = computes("cpu")
    assert dec.factor() == 1.0
    enc.busy_kind = "encode"
    assert dec.factor() == 2.0          # two on the same cores: half speed each
    pre.busy_kind = "prefill"
    assert dec.factor() == 3.0          # three: a third each
    assert dec.factor(skip=pre) == 2.0


def test_disjoint_cores_and_unprofiled_gpus_do_not_interfere():
    for device in ("cpu:{i}", "cuda:0"):
        enc, pre, dec = computes(device)
        enc.busy_kind, pre.busy_kind = "encode", "prefill"
        assert dec.factor() == 1.0, device


def test_a_measured_pair_takes_the_profiles_slowdown():
    prof = dataclasses.replace(make_profile(), interference=(Interference("decode", "encode", 1.25),))
    enc, pre, dec = computes("cpu", prof)
    enc.busy_kind = "encode"
    assert dec.factor() == 1.25
    pre.busy_kind = "prefill"           # not measured: processor sharing
    assert dec.factor() == 2.25


def test_shared_cores_lengthen_decode_steps_in_a_run():
    reqs = poisson(40, 4.0, seed=1, max_tokens=16)

    def tpot(device: str) -> float:
        recs = simulate(topo(device=device), make_profile(), reqs).records
        return statistics.median((r["chunk_s"][-1] - r["chunk_s"][0]) / 15 for r in recs if r["error"] is None)
    assert tpot("cpu") > 1.2 * tpot("cpu:{i}")
