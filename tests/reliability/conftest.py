"""Live stacks the reliability tests share (one per session): real processes, tiny models."""
from __future__ import annotations

import pytest

from easerve.models.tiny import cached_tiny
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack

ONE = {"threads": 1}


def fuzz_deployment(model: str, decode_instances: int) -> Deployment:
    """encode, prefill and `decode_instances` decode workers; a 1 MB HTTP body limit so that
    oversize bodies are cheap to send, and a short prompt limit so over-long prompts are too."""
    return Deployment(
        model=model, name="fuzz",
        encode=(Worker(flags={"max-batch": 4, "remote-fraction": 1.0, **ONE}),),
        prefill=(Worker(flags={"kv-transport": "grpc", **ONE}),),
        decode=tuple(Worker(flags={"num-slots": 4, **ONE}) for _ in range(decode_instances)),
    ).with_gateway_ports(0, 0).with_flags("gateway", max_body_mb=1.0, max_model_len=512, default_max_tokens=4)


def _start(model: str, decode_instances: int):
    stack = Stack(fuzz_deployment(model, decode_instances), env={"EASERVE_LOG_LEVEL": "WARNING"})
    stack.start(timeout=420)
    return stack


@pytest.fixture(scope="session")
def fuzz_vl(tiny_root):
    """Qwen2.5-VL (image + video) with two decode instances."""
    stack = _start(str(cached_tiny("qwen2.5-vl", tiny_root)), 2)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def fuzz_audio(tiny_root):
    """Qwen2-Audio, one instance per stage (its WAV / audio decoding is what is fuzzed)."""
    stack = _start(str(cached_tiny("qwen2-audio", tiny_root)), 1)
    yield stack
    stack.stop()
