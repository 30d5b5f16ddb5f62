"""SM backends on CPU: the affinity split really moves threads; fallbacks say why, and a
mechanism asked for by name that is not here fails instead of time-slicing."""
from __future__ import annotations

import os
import queue
import threading

import pytest

from easerve.partition.cpu_affinity import CpuAffinityBackend
from easerve.partition.backends import MPSBackend, PartitionController, StaticSplitBackend, TimeSliceBackend, select_backend
from easerve.partition.green_contexts import GreenContextBackend
from easerve.policy.partitioner import Allocation, SMPartitioner, measure_grid
from easerve.partition.sm_backend import BackendUnavailable, SMBackend
from tests.support.fake_gpu import fake_gpu, fake_latency

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class Worker(threading.Thread):
    """A thread that reports the affinity it sees itself (sched_getaffinity(0)) on request."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.asks: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self.ready = threading.Event()

    def run(self) -> None:
        self.tid = threading.get_native_id()
        self.ready.set()
        while self.asks.get() is not None:
            self.answers.put(frozenset(os.sched_getaffinity(0)))

    def seen(self) -> frozenset[int]:
        self.asks.put(True)
        return self.answers.get(timeout=5)

    def stop(self) -> None:
        self.asks.put(None)
        self.join(timeout=5)


def start_worker() -> Worker:
    w = Worker()
    w.start()
    w.ready.wait(5)
    return w


@needs_affinity
def test_affinity_follows_every_batch() -> None:
    enc, pre = start_worker(), start_worker()
    backend = CpuAffinityBackend()
    part = SMPartitioner(measure_grid(fake_latency, [1, 2, 4, 8]))
    try:
        backend.bind("encode", enc.tid)
        backend.bind("prefill", pre.tid)
        for b in [1, 8, 2, 4, 1, 3, 8, 1]:
            lv = backend.apply(part.choose(b))
            for name, w in (("encode", enc), ("prefill", pre)):
                want = backend.cores_for(name, lv)
                assert backend.current_affinity(name) == want == w.seen(), (b, name)
            e, p = backend.cores_for("encode", lv), backend.cores_for("prefill", lv)
            if len(e) < len(ALLOWED):  # prefill has cores of its own: a true split
                assert e.isdisjoint(p) and e | p == set(ALLOWED), (b, e, p)
            else:  # encode needs every core: prefill time-slices on all of them
                assert p == set(ALLOWED)
        if len(ALLOWED) < 2:
            pytest.skip(f"only {len(ALLOWED)} allowed core: the split itself was not exercised")
        backend.apply(Allocation(0.4, 0.6))  # 2 cores: 1 each
        assert len(enc.seen()) == len(backend.cores_for("encode")) < len(ALLOWED)
        assert enc.seen().isdisjoint(pre.seen())
        assert backend.apply(Allocation(1.0, 0.0)) == len(backend.levels) - 1
        assert enc.seen() == pre.seen() == set(ALLOWED)  # share 1.0: prefill time-slices
    finally:
        enc.stop()
        pre.stop()


def test_core_split_arithmetic() -> None:
    b = CpuAffinityBackend(cores=range(10)) if hasattr(os, "sched_setaffinity") else None
    if b is None:
        pytest.skip("Linux only")
    assert [len(b.cores_for("encode", i)) for i in range(5)] == [2, 4, 6, 8, 10]
    assert b.cores_for("prefill", 0) == set(range(2, 10))
    assert b.cores_for("prefill", 4) == set(range(10))
    two = CpuAffinityBackend(levels=(0.5,), cores=[3, 7])
    assert two.cores_for("encode") == {3} and two.cores_for("prefill") == {7}


@needs_affinity
def test_unbound_thread_pins_itself_for_a_block_and_restores() -> None:
    b = CpuAffinityBackend(levels=(0.5, 1.0))
    before = os.sched_getaffinity(0)
    with b.prefill_context(level=0):
        assert os.sched_getaffinity(0) == b.cores_for("prefill", 0)
    assert os.sched_getaffinity(0) == before


@needs_affinity
def test_dead_worker_is_dropped_not_fatal() -> None:
    w = start_worker()
    b = CpuAffinityBackend()
    b.bind("prefill", w.tid)
    w.stop()
    assert _gone(w.tid), "the exited thread's id was still present after 2 s"  # join() returns before the reap
    b.apply(Allocation(0.2, 0.8))
    assert b.lost == [("prefill", w.tid)]


def _gone(tid: int, timeout: float = 2.0) -> bool:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.sched_getaffinity(tid)
        except ProcessLookupError:
            return True
        time.sleep(0.005)
    return False


def test_timeslice_and_static_baselines() -> None:
    t = TimeSliceBackend()
    assert t.apply(Allocation(0.2, 0.8)) == 0 and t.levels == (1.0,)
    with t.encode_context(), t.prefill_context():
        pass
    s = StaticSplitBackend(CpuAffinityBackend(levels=(0.5,), cores=[0, 1]))
    assert s.apply(Allocation(1.0, 0.0)) == 0 and s.levels == (0.5,) and "on cpu_affinity" in s.reason
    assert s.realized() == Allocation(0.5, 0.5, 0)


def test_mps_probe_env_and_static_share(tmp_path) -> None:
    ok, why = MPSBackend.probe({})
    assert not ok and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in why
    assert not MPSBackend.probe({MPSBackend.ENV: "250"})[0]
    env = {**MPSBackend.env_for(0.6), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert env[MPSBackend.ENV] == "60"
    assert not MPSBackend.probe(env)[0]  # no daemon control pipe yet
    (tmp_path / "control").touch()
    m = MPSBackend(env)
    assert m.levels == (0.6,) and not m.dynamic
    m.apply(Allocation(0.2, 0.8))
    m.apply(Allocation(0.6, 0.4))
    assert m.mismatches == 1


def test_select_backend_falls_back_with_reason(tmp_path) -> None:
    cpu = select_backend("auto", "cpu")
    assert cpu.name == ("cpu_affinity" if len(ALLOWED) >= 2 else "timeslice")
    with pytest.raises(BackendUnavailable, match=r"--sm-backend green_contexts is not available on cpu: "
                                                 r"device is not CUDA\. Pick another --sm-backend"):
        select_backend("green", "cpu")
    assert select_backend("timeslice", "cpu").name == "timeslice"
    if len(ALLOWED) >= 2:
        st = select_backend("static", "cpu")
        assert st.name == "static" and st.levels == (0.5,) and st.inner.name == "cpu_affinity"
    with pytest.raises(ValueError, match="preference"):
        select_backend("fastest", "cpu")
    ok, why = GreenContextBackend.probe()
    assert GreenContextBackend.SUPPORTED is ok and why
    if not ok:  # no GPU here: green contexts are skipped in favour of a configured MPS
        env = {**MPSBackend.env_for(0.5), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
        (tmp_path / "control").touch()
        m = select_backend("auto", "cuda", env=env)
        assert m.name == "mps" and m.reason.startswith("green_contexts unavailable: ")
        assert "-> fell back to mps" in m.reason
        st = select_backend("static", "cuda", env=env)  # MPS at 50 %: the static split
        assert st.name == "static" and st.realized() == Allocation(0.5, 0.5, 0) and "on mps" in st.reason
        env[MPSBackend.ENV] = "60"  # not the split asked for: the start fails, saying what to set
        with pytest.raises(BackendUnavailable, match="needs CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 at launch"):
            select_backend("static", "cuda", env=env)


def test_partition_controller_moves_an_unbound_encode_thread() -> None:
    if not hasattr(os, "sched_setaffinity") or len(ALLOWED) < 2:
        pytest.skip("needs Linux and >= 2 allowed cores")
    part = SMPartitioner(measure_grid(fake_latency, [1, 8]))
    ctl = PartitionController(part, CpuAffinityBackend())
    before = os.sched_getaffinity(0)
    with ctl.encode_scope(1) as lv:
        assert ctl.requested.encode_share == 0.2 and os.sched_getaffinity(0) == ctl.backend.cores_for("encode", lv)
        assert len(os.sched_getaffinity(0)) < len(ALLOWED)
        # what is reported is what the cores give: ceil(0.2 x n) of n
        assert ctl.last.encode_share == len(os.sched_getaffinity(0)) / len(ALLOWED)
    with ctl.encode_scope(8):
        assert os.sched_getaffinity(0) == set(ALLOWED)
    assert os.sched_getaffinity(0) == before


def test_levels_validated() -> None:
    with pytest.raises(ValueError, match="levels"):
        SMBackend((0.5, 0.2), "unsorted")
    with pytest.raises(ValueError, match="static share"):
        StaticSplitBackend(TimeSliceBackend(), share=1.0)


@needs_affinity
def test_auto_falls_back_only_when_a_mechanism_is_unavailable_and_a_bad_argument_propagates() -> None:
    """A ValueError in a backend's constructor is not a missing mechanism: under auto (and
    under a named backend) it reaches the caller instead of turning into time-slicing."""
    bad = (0.7, 0.3)  # not increasing: CpuAffinityBackend's constructor refuses them
    with pytest.raises(ValueError, match=r"levels must be strictly increasing shares in \(0, 1\], got \[0.7, 0.3\]"):
        select_backend("auto", "cpu", bad)
    with pytest.raises(ValueError, match="levels must be strictly increasing"):
        select_backend("cpu_affinity", "cpu", bad)
    out: dict = {}

    def on_one_core() -> None:  # the mechanism really is missing: one core, nothing to split
        os.sched_setaffinity(0, {ALLOWED[0]})
        out["backend"] = select_backend("auto", "cpu")
    t = threading.Thread(target=on_one_core)
    t.start()
    t.join(30)
    ts = out["backend"]
    assert ts.name == "timeslice" and "cpu_affinity unavailable: only 1 allowed core: nothing to split" in ts.degraded


def _splits(log) -> list[int]:
    return [e[2] for e in log if e[0] == "split"]


def test_green_backend_levels_with_a_fake_driver(monkeypatch) -> None:
    log = fake_gpu(monkeypatch)
    b = GreenContextBackend()
    # ceil to the 8-SM alignment, then prefill's group cut from the remainder; 1.0 is not split
    assert _splits(log) == [32, 96, 56, 72, 80, 48, 112, 16]
    assert b.encode_sms == (32, 56, 80, 112, 132) and b.prefill_sms == (96, 72, 48, 16, 132)
    assert b.encode_stream(0).key[0] == "green" and b.prefill_stream(0).key[0] == "green"
    assert b.encode_stream(4).key == ("plain", "cuda:0", -1) and b.prefill_stream(4).key[2] == 0
    assert b.apply(Allocation(0.3, 0.7)) == 1
    s = b.encode_stream()
    del log[:]
    with b.encode_context() as got:
        assert got == s
    assert [e[0] for e in log] == ["wait", "push", "pop", "sync"]  # sync: only this stream is waited for
    assert log[0] == ("wait", s.key, ("outer",)) and log[-1] == ("sync", s.key)
    del log[:]
    with b.prefill_context(sync=False) as p:
        assert p == b.prefill_stream(1)
    assert [e[0] for e in log] == ["wait", "push", "pop"]
    del log[:]
    b.close()
    assert len(log) == 16  # 8 streams + 8 green contexts destroyed


def test_green_backend_remainder_that_fails_time_slices(monkeypatch) -> None:
    fake_gpu(monkeypatch, fail_remainder_below=24)
    b = GreenContextBackend()
    assert b.prefill_sms[3] == 132 and b.prefill_stream(3).key[0] == "plain"
    assert "share 0.8: prefill time-slices" in b.reason
    assert b.degraded == ("share 0.8: prefill time-slices (cuGreenCtxCreate failed: "
                          "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION)")  # visible, not silent
    assert b.realized(3) == Allocation(112 / 132, 1.0, 3)
