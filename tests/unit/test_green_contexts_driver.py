"""Green contexts against a stand-in driver module and torch.cuda, injected as parameters:
the probe names what is missing instead of calling it supported, prefill gets a split group
of its own, and every green stream's work runs with its own context current."""
from __future__ import annotations

import pytest

from easerve.partition.green_contexts import GreenContextBackend, check, probe
from hasctl.gpucheck.fakes import FakeDriver, fake_torch


def test_probe_names_missing_driver_entry_points() -> None:
    drv = FakeDriver(missing=("cuGreenCtxCreate", "cuCtxFromGreenCtx"))
    ok, why = probe(0, driver=drv, torch=fake_torch(drv))
    assert not ok
    assert "cuda.bindings.driver lacks cuGreenCtxCreate, cuCtxFromGreenCtx" in why and "12.8" in why
    with pytest.raises(RuntimeError, match="lacks cuGreenCtxCreate"):
        GreenContextBackend(driver=drv, torch=fake_torch(drv))


def test_probe_refuses_an_old_driver_and_accepts_a_complete_one() -> None:
    old = FakeDriver(version=12040)
    ok, why = probe(0, driver=old, torch=fake_torch(old))
    assert not ok and "supports CUDA 12.4; green contexts need >= 12.8" in why
    good = FakeDriver()
    assert probe(0, driver=good, torch=fake_torch(good, "H200")) == (True, "green contexts on H200")


def test_probe_without_cuda_bindings_says_what_to_install(monkeypatch) -> None:
    import builtins

    from easerve.partition import green_contexts as m
    real = builtins.__import__

    def no_bindings(name, *a, **k):
        if name.startswith("cuda.bindings") or (name == "cuda" and a and a[2] and "bindings" in a[2]):
            raise ImportError("No module named 'cuda.bindings'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bindings)
    ok, why = m.probe(0, torch=fake_torch(FakeDriver()))
    assert not ok and "pip install cuda-bindings" in why


def test_check_raises_with_the_call_and_error_name() -> None:
    drv = FakeDriver(align=8)
    assert check(drv.cuDriverGetVersion(), "v") == 12080
    with pytest.raises(RuntimeError, match="cuDevSmResourceSplitByCount failed: CUDA_ERROR_INVALID_RESOURCE"):
        check(drv.cuDevSmResourceSplitByCount(1, drv.cuDeviceGetDevResource(0, 1)[1], 0, 12),
              "cuDevSmResourceSplitByCount")


def test_prefill_group_is_split_from_the_remainder_or_is_the_raw_remainder() -> None:
    drv = FakeDriver(total_sms=132)
    b = GreenContextBackend((0.5, 1.0), driver=drv, torch=fake_torch(drv))
    assert b.encode_sms == (72, 132) and b.prefill_sms == (56, 132)  # 60 left, 56 = 7 x 8 of them
    assert [e for e in drv.log if e[0] == "split"] == [("split", 132, 72), ("split", 60, 56)]
    drv2 = FakeDriver(total_sms=132)
    raw = GreenContextBackend((0.5, 1.0), prefill_group="remainder", driver=drv2, torch=fake_torch(drv2))
    assert raw.prefill_sms == (60, 132) and len([e for e in drv2.log if e[0] == "split"]) == 1


def test_green_work_runs_with_its_own_context_current() -> None:
    drv = FakeDriver()
    b = GreenContextBackend((0.25, 1.0), driver=drv, torch=fake_torch(drv))
    del drv.log[:]
    with b.prefill_context(0, sync=False) as s:
        # inside the block the green context is current: events recorded here are its own
        assert drv.log[-1][0] == "push"
    # the wait on the caller's stream comes first (its event belongs to the caller's context)
    assert [e[0] for e in drv.log] == ["wait", "push", "pop"] and drv.log[0][1] == s.key
    del drv.log[:]
    with b.encode_context(1):  # level 1.0: plain streams of the primary context, nothing pushed
        pass
    assert [e[0] for e in drv.log] == ["wait", "sync"]
