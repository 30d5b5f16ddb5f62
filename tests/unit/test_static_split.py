"""The paper's baselines as they run: the static policy is exactly 50/50 on every backend that
can be built here (the GPU ones through their split plan and a stand-in driver), the fixed
backends (MPS below 100 %, --sm-backend static) start, and a missing mechanism is reported
(an error naming --sm-backend, or a degradation visible in describe() and the metrics)."""
from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest

from easerve.partition.cpu_affinity import CpuAffinityBackend
from easerve.partition.backends import MPSBackend, select_backend
from easerve.policy.partitioner import Allocation
from easerve.partition.green_contexts import sm_split
from easerve.policy.partitioner import (
    DEFAULT_SHARES, FixedPartitioner, PartitionerConfig, SMPartitioner, measure_grid, policy_levels)
from easerve.partition.backends import PartitionController
from easerve.partition.sm_backend import BackendUnavailable
from easerve.stages.encode.colocate import build_controller
from easerve.stages.encode.metrics import EncodeMetrics
from tests.support.fake_gpu import fake_gpu, fake_latency

ALLOWED = sorted(os.sched_getaffinity(0))
STATIC = PartitionerConfig(policy="static")
HALF = Allocation(0.5, 0.5, 0)


def test_static_policy_asks_exactly_half_at_every_batch_size() -> None:
    assert policy_levels(STATIC) == (0.5,)
    bare = SMPartitioner(None, STATIC)
    profiled = SMPartitioner(measure_grid(fake_latency, [1, 2, 4, 8]), STATIC)  # 0.5 is not a profiled level
    for b in range(1, 65):
        assert bare.choose(b) == HALF
        assert profiled.choose(b) == Allocation(0.5, 0.5, None)
    with pytest.raises(ValueError, match="the dynamic policy needs a LatencyGrid"):
        SMPartitioner(None, PartitionerConfig())


@pytest.mark.parametrize("n", range(1, 10))
def test_cpu_affinity_static_split_is_half_the_cores(n: int) -> None:
    b = CpuAffinityBackend(levels=policy_levels(STATIC), cores=range(n))
    enc, pre = b.cores_for("encode"), b.cores_for("prefill")
    r = b.realized()
    if n == 1:  # nothing to split: prefill shares the core, and says so
        assert enc == pre == {0} and r == Allocation(1.0, 0.0, 0)
    elif n % 2 == 0:
        assert len(enc) == len(pre) == n // 2 and enc.isdisjoint(pre) and r == HALF
    else:  # odd: encode (the critical path) gets the extra core, and that is what is reported
        assert len(enc) == (n + 1) // 2 and len(pre) == (n - 1) // 2 and enc.isdisjoint(pre)
        assert r == Allocation(((n + 1) // 2) / n, ((n - 1) // 2) / n, 0)


def test_static_on_the_live_cores_moves_both_workers_at_every_batch_size() -> None:
    if len(ALLOWED) < 2 or len(ALLOWED) % 2:
        pytest.skip(f"needs an even number >= 2 of allowed cores, have {len(ALLOWED)}")
    enc_pool = concurrent.futures.ThreadPoolExecutor(1)
    pre_pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        ctl = build_controller(None, "cpu", "auto", "static", None, (1,), 0.1, enc_pool, pre_pool)
        assert ctl.backend.name == "cpu_affinity" and ctl.partitioner.policy == "static"
        seen = lambda pool: pool.submit(lambda: frozenset(os.sched_getaffinity(0))).result()  # noqa: E731
        for b in range(1, 17):
            with ctl.encode_scope(b):
                pass
            assert ctl.requested == HALF and ctl.last == HALF
            e, p = seen(enc_pool), seen(pre_pool)
            assert len(e) == len(p) == len(ALLOWED) // 2 and e.isdisjoint(p)
        assert ctl.describe()["last"] == {"encode_share": 0.5, "prefill_share": 0.5, "level_index": 0}
        assert ctl.describe()["latency_grid"] is None and ctl.describe()["degraded"] == ""
    finally:
        enc_pool.shutdown()
        pre_pool.shutdown()


@pytest.mark.parametrize("total,align,want", [(132, 8, 64), (108, 2, 54), (144, 8, 72), (80, 8, 40), (46, 2, 24)])
def test_green_static_plan_is_the_nearest_granule_to_half(total: int, align: int, want: int) -> None:
    assert sm_split(total, align, align, 0.5, "nearest") == want
    assert abs(want - total / 2) <= align / 2
    assert sm_split(132, 8, 8, 0.5, "up") == 72  # the dynamic levels round up (encode-protective)
    with pytest.raises(ValueError, match="rounding"):
        sm_split(132, 8, 8, 0.5, "down")


@pytest.mark.parametrize("total,align", [(132, 8), (108, 2)])
def test_green_static_precreates_one_half_partition(monkeypatch, total: int, align: int) -> None:
    log = fake_gpu(monkeypatch, total=total, align=align)
    st = select_backend("static", "cuda")
    assert st.name == "static" and st.inner.name == "green_contexts"
    want = sm_split(total, align, align, 0.5, "nearest")
    pre = (total - want) // align * align  # prefill's own group, cut from the remainder
    assert [e[2] for e in log if e[0] == "split"] == [want, pre]  # made up front
    assert st.inner.encode_sms == (want,) and st.inner.prefill_sms == (pre,)
    assert st.realized() == Allocation(want / total, pre / total, 0)
    if total == 108:
        assert st.realized() == HALF
    st.close()


def test_green_static_fails_when_the_driver_refuses_prefills_half(monkeypatch) -> None:
    fake_gpu(monkeypatch, total=140, fail_remainder_below=70)  # 72 SMs granted, 68 refused
    with pytest.raises(BackendUnavailable, match="share 0.5: the driver refused the prefill group of the 68-SM remainder"):
        select_backend("static", "cuda")


@pytest.fixture
def mps_env(monkeypatch, tmp_path):
    from easerve.partition import green_contexts
    monkeypatch.setattr(green_contexts.GreenContextBackend, "probe", staticmethod(lambda i=0: (False, "no GPU")))
    (tmp_path / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv(MPSBackend.ENV, "50")


def test_mps_below_100_starts_under_every_policy(mps_env) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for policy, pref in [("dynamic", "mps"), ("static", "mps"), ("static", "auto"), ("dynamic", "static")]:
            ctl = build_controller(None, "cuda", pref, policy, None, (1, 2), 0.1, pool, pool)
            assert isinstance(ctl.partitioner, FixedPartitioner), (policy, pref)
            for b in (1, 3, 8):
                with ctl.encode_scope(b):
                    pass
                assert ctl.last == HALF, (policy, pref)  # encode and prefill inside the 50 % cap
            if policy == "dynamic":
                assert "--partition-policy dynamic has nothing to choose" in ctl.note
    finally:
        pool.shutdown()
    assert MPSBackend.env_for(0.5) == {MPSBackend.ENV: "50"}


def test_a_named_backend_that_is_missing_fails_the_start() -> None:
    with pytest.raises(BackendUnavailable, match="--sm-backend mps is not available on cpu: device is not CUDA"):
        select_backend("mps", "cpu")
    with pytest.raises(BackendUnavailable, match="--sm-backend cpu_affinity is not available on cuda"):
        select_backend("cpu_affinity", "cuda")


def _on_one_core(fn):
    """Run fn in a thread restricted to one core (affinity is per thread on Linux)."""
    out: dict = {}

    def body() -> None:
        os.sched_setaffinity(0, {ALLOWED[0]})
        try:
            out["v"] = fn()
        except BackendUnavailable as e:
            out["e"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    return out


def test_one_core_auto_degrades_visibly_static_and_named_fail() -> None:
    auto = _on_one_core(lambda: select_backend("auto", "cpu"))["v"]
    assert auto.name == "timeslice"
    assert auto.degraded.startswith("--sm-backend auto found no partition mechanism on cpu (cpu_affinity "
                                    "unavailable: only 1 allowed core: nothing to split)")
    assert auto.describe()["degraded"] == auto.degraded
    static = _on_one_core(lambda: select_backend("static", "cpu"))["e"]
    assert "no mechanism on cpu can realize the split [0.5]" in str(static) and "--device cpu:0-1" in str(static)
    named = _on_one_core(lambda: select_backend("cpu_affinity", "cpu"))["e"]
    assert str(named).startswith("--sm-backend cpu_affinity is not available on cpu: only 1 allowed core")
    m = EncodeMetrics(1.0)
    m.on_partition(auto.name, "dynamic", auto.degraded)
    assert m.registry.get_sample_value("easerve:encode_sm_partition_degraded") == 1.0
    assert m.registry.get_sample_value("easerve:encode_sm_partition", {"backend": "timeslice", "policy": "dynamic"}) == 1


def test_controller_reports_what_the_cores_give_not_what_was_asked() -> None:
    b = CpuAffinityBackend(DEFAULT_SHARES, cores=[0, 1])  # 0.2 and 0.4 both round up to 1 of 2 cores
    ctl = PartitionController(FixedPartitioner(Allocation(0.2, 0.8), "fixed"), b)
    with ctl.encode_scope(1):
        pass
    assert ctl.requested == Allocation(0.2, 0.8) and ctl.last == Allocation(0.5, 0.5, 0)


def test_contradicting_policy_and_backend_flags_are_refused() -> None:
    from easerve.stages.common.configs import EncodeConfig
    base = dict(model="m", colocate_prefill=True, decode=("127.0.0.1:1",))
    with pytest.raises(ValueError, match="--partition-policy static contradicts --sm-backend timeslice: drop one"):
        EncodeConfig(**base, partition_policy="static", sm_backend="timeslice")
    ok = EncodeConfig(**base, sm_backend="static")
    assert ok.sm_backend == "static" and ok.partition_policy == "dynamic"  # starts; runs as static
