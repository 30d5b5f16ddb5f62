"""Embeddings from encode to remote prefill cross through the KV transports, not as protobuf
bytes: on one host, shared memory. A dynamo-like deployment (all prefill remote) with two
prefill instances and two encode instances: encode-0 chooses its transport (auto: shared
memory here), encode-1 is forced to the fallback (--embed-transport inline). The transports'
byte counts (easerve:embed_sent_bytes / easerve:embed_received_bytes by transport) show that
encode-0 put no embedding byte into a message and handed exactly its requests' embedding
bytes over shared memory; both paths give the same greedy tokens; and once the requests are
done encode-0 holds no shared memory for them."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
import urllib.request
from pathlib import Path

import pytest

from easerve import Client
from easerve.models.tiny import cached_tiny
from hasctl.deployment import Worker, preset
from hasctl.launch import Stack, free_port
from tests.support.media import png_bytes
from tests.support.prom import metric

pytestmark = pytest.mark.slow
ONE = {"threads": 1, "encoder-cache-gb": 0}  # no cache (and no media affinity at the gateway): placed by load


def _metrics_flag() -> dict:
    return {"metrics-listen": f"127.0.0.1:{free_port()}"}


@pytest.fixture(scope="module")
def stack(tiny_root):
    d = preset("dynamo-like").with_model(str(cached_tiny("qwen2.5-vl", tiny_root))).with_gateway_ports(0, 0)
    enc = d.encode[0]
    d = dataclasses.replace(
        d, encode=tuple(dataclasses.replace(enc, flags={**dict(enc.flags), **ONE, **_metrics_flag(), **extra})
                        for extra in ({}, {"embed-transport": "inline"})),
        prefill=tuple(Worker(flags={"threads": 1, **_metrics_flag()}) for _ in range(2)),
        decode=(Worker(flags={"threads": 1, "num-slots": 8}),)).with_flags("gateway", media_hash_entries=0)
    s = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    s.start(timeout=420)
    yield s
    s.stop()


def _scrape(stack, name: str) -> str:
    argv = stack._procs[name].cmd.argv
    addr = argv[argv.index("--metrics-listen") + 1]
    return urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()


def _sent(stack, name: str, transport: str) -> float:
    return metric(_scrape(stack, name), "easerve:embed_sent_bytes_total", transport=transport)


def test_embeddings_cross_shared_memory_without_a_protobuf_copy(stack):
    client = Client(stack.endpoints.grpc, timeout=180)
    image = png_bytes(56, 84, 7)
    answers = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(4):  # two at once: the gateway puts the second on the encoder the first left idle
            answers += pool.map(lambda _: list(client.generate(prompt="What is this?", images=[image],
                                                               max_tokens=6).token_ids), range(2))
            if _sent(stack, "encode-0", "shm") and _sent(stack, "encode-1", "inline"):
                break
    e0, e1 = _scrape(stack, "encode-0"), _scrape(stack, "encode-1")
    served = [metric(t, "easerve:encode_routed_total", route="remote") for t in (e0, e1)]
    assert served[0] >= 1 and served[1] >= 1, \
        f"each encoder should have served a request: {served}\n{stack.log_tail('encode-0', 40)}\n{stack.log_tail('gateway', 40)}"
    shm, inline = (metric(e0, "easerve:embed_sent_bytes_total", transport=k) for k in ("shm", "inline"))
    fallback = metric(e1, "easerve:embed_sent_bytes_total", transport="inline")
    per_request = fallback / served[1]  # the same image every time: the same embedding bytes
    hidden = json.loads((Path(stack.deployment.model) / "config.json").read_text())["vision_config"]["out_hidden_size"]
    assert per_request > 0 and per_request % hidden == 0
    assert inline == 0, f"encode-0 put {inline} embedding bytes into protobuf messages"
    assert shm == served[0] * per_request
    assert metric(e1, "easerve:embed_sent_bytes_total", transport="shm") == 0
    prefills = [_scrape(stack, f"prefill-{i}") for i in range(2)]
    assert sum(metric(t, "easerve:embed_received_bytes_total", transport="shm") for t in prefills) == shm
    assert sum(metric(t, "easerve:embed_received_bytes_total", transport="inline") for t in prefills) == fallback
    assert all(a == answers[0] for a in answers), f"paths disagree: {answers}"
    end = time.monotonic() + 10  # a slab region is back once prefill's last view of it dies
    while metric(_scrape(stack, "encode-0"), "easerve:embed_sender_held_bytes") and time.monotonic() < end:
        time.sleep(0.2)
    assert metric(_scrape(stack, "encode-0"), "easerve:embed_sender_held_bytes") == 0
