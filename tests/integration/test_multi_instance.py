"""Several instances per stage on one host: 2 prefill x 2 decode behind one encode, one
prefill handing KV over shared memory and the other over the gRPC stream. A mixed load
(image, video, text; audio on its own model) completes with the same greedy tokens as
the one-instance stack; KV lands at the decode instance that holds the reservation;
killing one decode instance lets new requests flow to the other; and encode and prefill
hold nothing once a request's first token is out."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import pytest

from easerve import Client
from easerve.wire.v1 import stage_pb2, stage_pb2_grpc
from hasctl.launch import Stack
from tests.support.prom import metric, scrape
from tests.support.media import no_media_ids, png_bytes, wav_bytes
from tests.support.multi_stack import N, kv_received, start_multi, mixed_requests, run_all, scrape_stage

pytestmark = pytest.mark.slow
DEADLINE_S = 60.0  # each request's deadline in the KV-placement test


@pytest.fixture(scope="module")
def vl_multi(tiny_root, vl_stack):
    stack = start_multi(vl_stack.deployment.model)
    stack.start(timeout=420)
    yield stack
    stack.stop()


def _load(stack, name: str) -> stage_pb2.LoadResponse:
    with grpc.insecure_channel(stack.endpoints.stages[name]) as ch:
        return stage_pb2_grpc.StageStub(ch).Load(stage_pb2.LoadRequest(), timeout=10)


def test_mixed_load_on_2x2_equals_one_instance(vl_multi, vl_stack):
    reqs = mixed_requests()
    want = [list(Client(vl_stack.endpoints.grpc, timeout=180).generate(max_tokens=N, **kw).token_ids)
            for _, kw in reqs]
    got = run_all(vl_multi, reqs)
    assert got == want
    # both decode instances took work, through both transports; nothing is left held anywhere
    names = ("decode-0", "decode-1", "prefill-0", "prefill-1", "encode-0")
    end = time.monotonic() + 10  # a call's bookkeeping ends just after its last message reached the client
    served = {n: _load(vl_multi, n) for n in names}
    while any(s.inflight for s in served.values()) and time.monotonic() < end:
        time.sleep(0.1)
        served = {n: _load(vl_multi, n) for n in names}
    assert all(s.inflight == 0 for s in served.values()), served
    assert {s.node.host_id for s in served.values()} == {served["encode-0"].node.host_id}
    received = {n: kv_received(vl_multi, n) for n in ("decode-0", "decode-1")}
    assert all(sum(r.values()) > 0 for r in received.values()), received  # both decode instances decoded
    assert sum(r.get("shm", 0) for r in received.values()) > 0, received    # prefill-0's KV over shm
    assert sum(r.get("grpc", 0) for r in received.values()) > 0, received   # prefill-1's over the gRPC stream
    for name, kind in (("prefill-0", "shm"), ("prefill-1", "grpc")):  # prefill's own metrics say the same
        text = scrape_stage(vl_multi, name)
        assert f'easerve:kv_transfer_seconds_count{{transport="{kind}"}}' in text, text
        assert "easerve:prefill_batch_size_count" in text and "easerve:prefill_queue_depth 0.0" in text
    decode = scrape_stage(vl_multi, "decode-0")
    assert "easerve:kv_cache_usage_perc" in decode and "easerve:decode_batch_size_count" in decode


def test_cpu_core_devices_pin_the_stage(vl_multi):
    cores = sorted(os.sched_getaffinity(0))
    for i in range(2):
        want = {cores[i % len(cores)]}
        assert os.sched_getaffinity(vl_multi.pids[f"decode-{i}"]) == want


def test_kv_goes_to_the_decode_that_holds_the_reservation(vl_multi):
    """Many concurrent requests over 2 decode instances: with the KV sent anywhere else, a
    request would wait out its deadline (DEADLINE_S); here every one gets all its tokens in
    under half of it."""
    client = Client(vl_multi.endpoints.grpc, timeout=DEADLINE_S)

    def timed(k: int) -> tuple[int, float]:
        t0 = time.monotonic()
        out = client.generate(f"Say {k}", max_tokens=4, ignore_eos=True)
        return out.usage.completion_tokens, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(timed, range(16)))
    assert [n for n, _ in outs] == [4] * 16, outs
    assert max(s for _, s in outs) < DEADLINE_S / 2, outs


def test_encode_and_prefill_hold_nothing_once_decoding(vl_multi):
    client = Client(vl_multi.endpoints.grpc, timeout=120)
    stream = client.generate("What is this?", images=[png_bytes(40, 40, 3)], max_tokens=400, stream=True,
                             ignore_eos=True)
    seen = 0
    for chunk in stream:
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    # the encode call ends once prefill's KV handoff has returned, which may come a few decode
    # steps after the first tokens on a loaded host: poll while the request is still decoding
    end = time.monotonic() + 20
    while True:
        loads = {n: _load(vl_multi, n) for n in ("encode-0", "prefill-0", "prefill-1", "decode-0", "decode-1")}
        upstream = loads["encode-0"].inflight + loads["encode-0"].queued + loads["prefill-0"].inflight + \
            loads["prefill-1"].inflight
        if upstream == 0 or time.monotonic() > end:
            break
        time.sleep(0.1)
    stream.close()
    assert loads["encode-0"].inflight == 0 and loads["encode-0"].queued == 0
    assert loads["prefill-0"].inflight == 0 and loads["prefill-1"].inflight == 0
    assert loads["decode-0"].inflight + loads["decode-1"].inflight == 1


def test_audio_on_2x2_equals_one_instance(tiny_root, audio_stack):
    reqs = [("audio", {"prompt": "What is this?", "audio": wav_bytes(0.3 + 0.1 * k, 200 + 50 * k)}) for k in range(4)]
    reqs.append(("text", {"prompt": "Hello"}))
    want = [list(Client(audio_stack.endpoints.grpc, timeout=180).generate(max_tokens=N, **kw).token_ids)
            for _, kw in reqs]
    with start_multi(audio_stack.deployment.model) as stack:
        assert run_all(stack, reqs) == want


def test_both_decode_instances_send_tokens_several_a_message_and_the_same_tokens(vl_multi, vl_stack):
    """--stream-interval-ms (STREAM_INTERVAL_MS on both decode instances of the 2x2 stack): a
    stream's tokens after the first come several to a gRPC message, on each decode instance, and
    they are the greedy tokens of the one-instance stack (default interval), none lost, none twice."""
    no_media = no_media_ids(vl_multi.deployment.model)
    ask = [dict(prompt=f"Count to {k}", max_tokens=40, ignore_eos=True, logit_bias=no_media) for k in range(6)]
    want = [list(Client(vl_stack.endpoints.grpc, timeout=180).generate(**kw).token_ids) for kw in ask]
    before = {n: sum(kv_received(vl_multi, n).values()) for n in ("decode-0", "decode-1")}
    client = Client(vl_multi.endpoints.grpc, timeout=180)

    def streamed(kw):
        msgs = [list(m.token_ids) for m in client.generate(stream=True, **kw)]
        return [t for m in msgs for t in m], sum(1 for m in msgs if m)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(streamed, ask))
    assert [ids for ids, _ in got] == want
    assert all(len(ids) == 40 for ids in want)
    assert all(msgs <= 10 for _, msgs in got), [msgs for _, msgs in got]  # 40 tokens: 1 per message without it
    after = {n: sum(kv_received(vl_multi, n).values()) for n in before}
    assert all(after[n] > before[n] for n in before), (before, after)  # both instances decoded some


def _finish(stream, first) -> int | Exception:
    """The stream's token count once it ends, or the error it ended with."""
    n = len(first.token_ids)
    try:
        for chunk in stream:
            n += len(chunk.token_ids)
    except Exception as e:  # noqa: BLE001 - the test sorts the outcomes
        return e
    return n


def test_killing_one_decode_lets_new_requests_flow_to_the_other(vl_multi):
    """The requests decoding on the killed instance (the one holding the most) migrate to the
    survivor (the gateway's --migration-limit) and finish in full, like the others; new
    requests go to the survivor. (The tiny random model is kept from emitting media
    placeholder ids, which a migration cannot re-prefill as text.)"""
    client = Client(vl_multi.endpoints.grpc, timeout=60)
    no_media = no_media_ids(vl_multi.deployment.model)
    streams = [client.generate(f"Count {k}", max_tokens=200, ignore_eos=True, stream=True, logit_bias=no_media)
               for k in range(4)]
    firsts = [next(s) for s in streams]  # every request has its first token
    end = time.monotonic() + 30
    while sum((held := {n: _load(vl_multi, n).inflight for n in ("decode-0", "decode-1")}).values()) < 4:
        assert time.monotonic() < end, f"not every request reached a decode instance: {held}"
        time.sleep(0.02)  # its KV is still on the way
    victim = max(held, key=held.get)
    survivor = next(n for n in held if n != victim)
    os.kill(vl_multi.pids[victim], signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(_finish, streams, firsts, timeout=90))  # none hangs
    assert done == [200] * 4, done
    assert metric(scrape(f"{vl_multi.endpoints.http}/metrics"), "easerve:migrations_total", stage="decode",
                  reason="died") == held[victim]
    after = [client.generate(f"Again {k}", images=[png_bytes(40, 40, k)] if k % 2 else (), max_tokens=4)
             for k in range(6)]
    assert all(o.usage.completion_tokens >= 1 for o in after)
    assert _load(vl_multi, survivor).inflight == 0


def test_monolith_answers_like_the_one_instance_stack(vl_stack):
    from hasctl.deployment import preset
    reqs = mixed_requests()[:5]
    want = [list(Client(vl_stack.endpoints.grpc, timeout=180).generate(max_tokens=N, **kw).token_ids)
            for _, kw in reqs]
    d = preset("monolith").with_model(vl_stack.deployment.model).with_gateway_ports(0, 0)
    with Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"}) as mono:
        assert set(mono.pids) == {"monolith-0", "gateway"}
        assert run_all(mono, reqs, workers=3) == want
        assert _load(mono, "monolith-0").inflight == 0
