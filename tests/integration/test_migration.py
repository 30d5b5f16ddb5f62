"""Mid-stream migration on a live stack with two decode instances: a request whose decode
instance is killed (kill -9) or stalls (SIGSTOP) after its 5th token goes on at the other
one, and the client gets exactly the tokens and the text of an undisturbed run of the same
request: a seeded sampled text request through prefill, and a greedy image request through
encode again. The gateway counts each move in easerve:migrations_total{stage,reason} and in
the response's usage."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from easerve.wire.v1 import stage_pb2, stage_pb2_grpc
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack
from tests.support.media import no_media_ids, png_bytes
from tests.support.prom import metric, scrape

pytestmark = pytest.mark.slow
DECODES = ("decode-0", "decode-1")
PROGRESS_S = 3.0  # the gateway's --decode-progress-timeout-s (under the ~5-10 s keepalive)
TOKENS = 300      # long enough that the stream is still going when the fault comes


@pytest.fixture(scope="module")
def stack(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    one = {"threads": 1}
    d = Deployment(model=model, name="migrate", encode=(Worker(flags=one),), prefill=(Worker(flags=one),),
                   decode=tuple(Worker(flags={"num-slots": 4, **one}) for _ in DECODES)).with_gateway_ports(0, 0)
    d = d.with_flags("gateway", decode_progress_timeout_s=PROGRESS_S)
    with Stack(d, restart=False, env={"EASERVE_LOG_LEVEL": "WARNING"}) as s:
        yield s


def _inflight(stack, name: str) -> int:
    with grpc.insecure_channel(stack.endpoints.stages[name]) as ch:
        return stage_pb2_grpc.StageStub(ch).Load(stage_pb2.LoadRequest(), timeout=10).inflight


def _migrations(stack, reason: str) -> float:
    """The gateway's easerve:migrations_total of stage decode for `reason`."""
    return metric(scrape(f"{stack.endpoints.http}/metrics"), "easerve:migrations_total", stage="decode", reason=reason)


def _disturbed(stack, client: Client, kw: dict, fault) -> tuple[list[int], str, int]:
    """(token ids, text, usage.migrations) of the request streamed with `fault(pid)` done to
    the decode instance serving it right after its 5th token."""
    ids, text, usage, faulted = [], [], None, False
    for chunk in client.generate(max_tokens=TOKENS, ignore_eos=True, stream=True, **kw):
        ids += chunk.token_ids
        text.append(chunk.text)
        usage = chunk.usage or usage
        if len(ids) >= 5 and not faulted:
            serving = [n for n in DECODES if _inflight(stack, n) == 1]
            assert len(serving) == 1, f"the request is not at one decode instance: {serving}"
            fault(stack.pids[serving[0]])
            faulted = True
    assert faulted
    return ids, "".join(text), usage.migrations


def _undisturbed(client: Client, kw: dict) -> tuple[list[int], str]:
    out = client.generate(max_tokens=TOKENS, ignore_eos=True, **kw)
    assert len(out.token_ids) == TOKENS
    return list(out.token_ids), out.text


def test_stalled_decode_greedy_image_request_resumes_on_the_other(stack):
    """SIGSTOP of the serving decode instance: after PROGRESS_S without a token the request
    moves (encode runs again, its cache holding the image), and ends like the undisturbed run."""
    client = Client(stack.endpoints.grpc, timeout=180)
    kw = {"prompt": "What is this?", "images": [png_bytes(48, 64, 5)],
          "logit_bias": no_media_ids(stack.deployment.model)}
    want = _undisturbed(client, kw)
    before = _migrations(stack, "stalled")
    stopped = []

    def stall(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        t0 = time.monotonic()
        ids, text, moved = _disturbed(stack, client, kw, stall)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert (ids, text) == want
    assert moved == 1 and _migrations(stack, "stalled") == before + 1
    assert time.monotonic() - t0 < PROGRESS_S + 60  # the progress deadline, not the client's 180 s
    end = time.monotonic() + 20  # the stalled instance, back, drops the cancelled request
    while sum(_inflight(stack, n) for n in DECODES) and time.monotonic() < end:
        time.sleep(0.2)
    assert [_inflight(stack, n) for n in DECODES] == [0, 0]


def test_killed_decode_seeded_stream_goes_on_with_the_same_tokens(stack):
    """kill -9 of the serving decode instance after the 5th token of a seeded sampled stream:
    the client gets the undisturbed run's tokens and text, none twice, none missing."""
    client = Client(stack.endpoints.grpc, timeout=180)
    kw = {"prompt": "Tell me a story about a lighthouse", "temperature": 0.9, "top_k": 50, "seed": 4242,
          "logit_bias": no_media_ids(stack.deployment.model)}
    want = _undisturbed(client, kw)
    assert _undisturbed(client, {**kw, "seed": 4243}) != want  # the seed drives the draw
    before = _migrations(stack, "died")
    ids, text, moved = _disturbed(stack, client, kw, lambda pid: os.kill(pid, signal.SIGKILL))
    assert (ids, text) == want
    assert moved == 1 and _migrations(stack, "died") == before + 1
