"""`--kv-transport nccl` between real processes on CPU: 2 prefill x 2 decode instances, each
prefill forming its own pair group with each decode instance it hands KV to (gloo underneath,
the code path NCCL takes on GPUs). Greedy tokens equal the one-instance stack's (KV over shared
memory); every KV crossed a pair group, and the bytes decode took in are the prompt's KV,
layer by layer (what the shm path carries for the same requests)."""
from __future__ import annotations

import re

import pytest
from transformers import AutoConfig

from easerve import Client
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.support.multi_stack import N, ONE, mixed_requests, run_all, scrape_stage

pytestmark = pytest.mark.load  # ~2 min (its own 2x2 stack): with the long tests, .ci/run's second command


@pytest.fixture(scope="module")
def nccl_2x2(vl_stack):
    metrics = lambda: {"metrics-listen": f"127.0.0.1:{free_port()}"}  # noqa: E731
    d = Deployment(
        model=vl_stack.deployment.model, name="nccl2x2",
        encode=(Worker(flags={"max-batch": 4, **ONE}),),
        prefill=tuple(Worker(flags={"kv-transport": "nccl", **metrics(), **ONE}) for _ in range(2)),
        decode=tuple(Worker(flags={"num-slots": 8, "kv-rendezvous": "127.0.0.1:0", **metrics(), **ONE})
                     for _ in range(2))).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    stack.start(timeout=420)
    yield stack
    stack.stop()


def _counter(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}\{{transport="(\w+)"\}} (\S+)$', text, re.M)}


def _kv_bytes_per_token(model: str) -> int:
    text = AutoConfig.from_pretrained(model).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4  # float32 on CPU


def test_nccl_pairs_carry_the_kv_of_2x2_like_shared_memory(nccl_2x2, vl_stack):
    reqs = mixed_requests()
    ref = Client(vl_stack.endpoints.grpc, timeout=180)
    want = [ref.generate(max_tokens=N, **kw) for _, kw in reqs]
    outs = []
    client = Client(nccl_2x2.endpoints.grpc, timeout=180)
    got = run_all(nccl_2x2, reqs)
    assert got == [list(w.token_ids) for w in want]
    for _, kw in reqs[:2]:  # the prompt lengths of the same requests, for the byte count below
        outs.append(client.generate(max_tokens=N, **kw))
    per_decode = {n: scrape_stage(nccl_2x2, n) for n in ("decode-0", "decode-1")}
    counts = {n: _counter(t, "easerve:kv_receive_seconds_count") for n, t in per_decode.items()}
    assert all(set(c) == {"nccl"} and c["nccl"] > 0 for c in counts.values()), counts  # both, only over pairs
    for n in ("prefill-0", "prefill-1"):
        assert 'easerve:kv_transfer_seconds_count{transport="nccl"}' in scrape_stage(nccl_2x2, n)
    got_bytes = sum(_counter(t, "easerve:kv_receive_bytes_total")["nccl"] for t in per_decode.values())
    prompts = sum(w.usage.prompt_tokens for w in want) + sum(o.usage.prompt_tokens for o in outs)
    assert got_bytes == prompts * _kv_bytes_per_token(vl_stack.deployment.model)
