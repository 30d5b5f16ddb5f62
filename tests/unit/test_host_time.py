"""Host CPU accounting (easerve.stages.common.host_time): thread CPU time by phase, into the
`easerve:host_cpu_seconds_total{stage,phase}` counter and a request's HostAccount."""
from __future__ import annotations

import threading
import time

import pytest

from easerve.stages.common.host_time import HostAccount, HostTime
from easerve.stages.common.metrics import new_registry, render


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _value(registry, stage: str, phase: str) -> float:
    want = f'easerve:host_cpu_seconds_total{{phase="{phase}",stage="{stage}"}} '
    for line in render(registry).decode().splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise AssertionError(f"{want!r} not exported")


def test_cpu_inside_a_phase_is_charged_to_it_and_to_the_request():
    r, acc = new_registry(), HostAccount()
    host = HostTime(r, "gateway")
    with host.phase("tokenize", acc):
        _spin(0.05)
    assert 0.05 <= _value(r, "gateway", "tokenize") < 0.5
    assert acc.seconds["tokenize"] == pytest.approx(_value(r, "gateway", "tokenize"))
    assert _value(r, "gateway", "parse") == 0.0  # every phase exported, at zero until charged
    assert list(acc.as_ms()) == ["tokenize"] and acc.as_ms()["tokenize"] >= 50


def test_waiting_and_other_threads_are_not_charged():
    """Thread CPU time, not wall: a sleep inside the phase and another thread spinning meanwhile
    add (almost) nothing."""
    r = new_registry()
    host = HostTime(r, "encode")
    other = threading.Thread(target=_spin, args=(0.2,))
    with host.phase("serialize"):
        other.start()
        time.sleep(0.2)
        other.join()
    assert _value(r, "encode", "serialize") < 0.02


def test_timed_runs_in_an_executor_thread_and_add_takes_other_process_time():
    from concurrent.futures import ThreadPoolExecutor

    r, acc = new_registry(), HostAccount()
    host = HostTime(r, "gateway")
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(host.timed("media", lambda x: _spin(0.03) or x + 1, acc), 1).result() == 2
    host.add("media", 0.5, acc)  # e.g. a decode worker's process_time
    assert 0.53 <= acc.seconds["media"] < 1.0
    assert acc.seconds["media"] == pytest.approx(_value(r, "gateway", "media"))
    assert acc.total() == acc.seconds["media"]


def test_unknown_phase_is_refused():
    host = HostTime(new_registry(), "decode")
    with pytest.raises(ValueError, match="unknown host phase 'gpu'"):
        host.add("gpu", 1.0)
