"""hasctl.launch.Stack: real processes on free ports, health, restart of a killed stage, clean stop.

Two flavours: fake stages (a script that only serves grpc health, so the launcher's own logic
is checked in seconds) and the real stages on the default tiny checkpoint.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from hasctl.deployment import STAGES, preset
from hasctl.launch import Stack, StageExited
from tests.support.fake_stage import write_fake_python
from tests.support.procs import gone, group_gone

pytestmark = pytest.mark.slow


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _kill_decode_and_see_it_back(stack: Stack, timeout: float) -> None:
    old = stack.pids["decode-0"]
    os.kill(old, signal.SIGKILL)
    _wait_for(lambda: stack.restarts["decode-0"] == 1, 60, "the decode restart")
    stack.wait_healthy(timeout)
    assert stack.pids["decode-0"] != old and stack.healthy("decode-0")
    assert sum(stack.restarts.values()) == 1


def _stop_and_check_nothing_left(stack: Stack, pids: dict) -> None:
    stack.stop(grace_s=2.0)
    for name, pid in pids.items():
        assert gone(pid) and group_gone(pid), f"{name} ({pid}) is still running after stop()"


@pytest.fixture
def fake_python(tmp_path):
    return write_fake_python(tmp_path / "fake-python")


def _fake_stack(tmp_path, fake_python, **env) -> Stack:
    d = preset("default").with_model("/no/model/needed").with_gateway_ports(0, 0)
    env.setdefault("FAKE_KIDS", str(tmp_path / "kids"))
    return Stack(d, run_dir=tmp_path / "run", python=fake_python, backoff_s=(0.1, 1.0), env=env)


def test_fake_stack_restarts_and_stops_everything(tmp_path, fake_python):
    stack = _fake_stack(tmp_path, fake_python, FAKE_IGNORE_TERM="prefill")
    try:
        stack.start(timeout=60)
        e = stack.endpoints
        assert e.grpc.startswith("127.0.0.1:") and e.http.startswith("http://127.0.0.1:")
        assert len(set(stack.ports.values())) == 5  # 4 gRPC ports + the HTTP one
        _kill_decode_and_see_it_back(stack, timeout=60)
        kids = [int(x) for x in (tmp_path / "kids").read_text().split()]
        assert len(kids) == 2
        _wait_for(lambda: gone(kids[0]), 10, "the killed decode's grandchild")
    finally:
        pids = dict(stack.pids)
        _stop_and_check_nothing_left(stack, pids)  # prefill ignores SIGTERM: SIGKILL after the grace
    assert all(gone(k) for k in kids)
    assert "start #1" in (tmp_path / "run" / "decode-0.log").read_text()


def test_fake_stack_fails_fast_with_the_log_tail(tmp_path, fake_python):
    stack = _fake_stack(tmp_path, fake_python, FAKE_FAIL="prefill")
    t0 = time.monotonic()
    with pytest.raises(StageExited, match=r"(?s)prefill-0 exited with code 3.*boom: this stage cannot start"):
        stack.start(timeout=60)
    assert time.monotonic() - t0 < 30
    assert all(gone(p) for p in stack.pids.values())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from easerve.models.tiny import DEFAULT_FAMILY, cached_tiny

    return cached_tiny(DEFAULT_FAMILY, tmp_path_factory.mktemp("tiny"))


def test_real_stack_restarts_a_killed_decode(tmp_path, tiny_model):
    d = preset("default").with_model(str(tiny_model)).with_gateway_ports(0, 0)
    for stage in (*STAGES, "gateway"):
        d = d.with_flags(stage, threads=1)
    stack = Stack(d, run_dir=tmp_path / "run", backoff_s=(0.2, 2.0))
    try:
        stack.start(timeout=300)
        assert all(stack.healthy(n) for n in stack.pids)
        _kill_decode_and_see_it_back(stack, timeout=300)
    finally:
        pids = dict(stack.pids)
        _stop_and_check_nothing_left(stack, pids)


def test_a_run_that_served_restarts_without_backing_off(tmp_path, fake_python):
    """Killed three times in a row, each time once it serves again (well within a minute): every
    restart comes after the base delay (1 s here), not 1, 2 then 4 s; the backoff is for runs that
    die before they serve (a crash loop)."""
    d = preset("default").with_model("/no/model/needed").with_gateway_ports(0, 0)
    stack = Stack(d, run_dir=tmp_path / "run", python=fake_python, backoff_s=(1.0, 8.0),
                  env={"FAKE_KIDS": str(tmp_path / "kids")})
    waits = []
    try:
        stack.start(timeout=60)
        for k in range(1, 4):
            _wait_for(lambda: stack._procs["decode-0"].served, 30, "the supervisor seeing decode-0 serve")
            old = stack.pids["decode-0"]
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
            _wait_for(lambda: stack.restarts["decode-0"] == k, 30, f"restart {k}")
            waits.append(time.monotonic() - t0)
            stack.wait_healthy(60)
    finally:
        pids = dict(stack.pids)
        _stop_and_check_nothing_left(stack, pids)
    assert max(waits) < 2.2, waits  # the third would wait 4 s with the backoff
