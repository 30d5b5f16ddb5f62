"""Real stacks of real processes on 127.0.0.1 free ports, started once per session."""
from __future__ import annotations

import pytest

from easerve.models.tiny import cached_tiny
from hasctl.deployment import preset
from hasctl.launch import Stack, free_port
from tests.support.multi_stack import start_multi


def _stack(model: str, preset_name: str, **stage_flags) -> Stack:
    d = preset(preset_name).with_model(model).with_gateway_ports(0, 0)  # 0: free ports
    for stage, flags in stage_flags.items():
        d = d.with_flags(stage, **flags)
    return Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})


@pytest.fixture(scope="session")
def vl_stack(tiny_root):
    """Qwen2.5-VL (image + video), co-located prefill with s = 0.5: both prefill paths live."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    stack = _stack(model, "colocated", decode={"max_seq_len": 4096, "num_slots": 8, "threads": 1},
                   encode={"threads": 1, "metrics_listen": f"127.0.0.1:{free_port()}"}, prefill={"threads": 1})
    stack.start(timeout=420)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def audio_stack(tiny_root):
    model = str(cached_tiny("qwen2-audio", tiny_root))
    stack = _stack(model, "default", decode={"threads": 1}, encode={"threads": 1}, prefill={"threads": 1})
    stack.start(timeout=420)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def multi(tiny_root):
    """The 2x2 stack (tests.support.multi_stack) on the tiny Qwen2.5-VL checkpoint, one per test module."""
    stack = start_multi(str(cached_tiny("qwen2.5-vl", tiny_root)))
    stack.start(timeout=420)
    yield stack
    stack.stop()
