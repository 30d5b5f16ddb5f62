"""The encoder cache through the real stack: greedy tokens equal with the cache on and off
for image, video and audio (and every family); a repeat is a hit that the gateway serves
without decoding its media or running the HF processor (its timings and the gateway's
/metrics say so) and sends to encode without pixels; a late miss (the request reaches an
instance that does not hold the media) is preprocessed in full and resent; N concurrent
requests for one new image run the tower once even with two encode instances; hits, misses,
evictions and held bytes in encode's /metrics, within the byte bound."""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from easerve import Client
from easerve.media import decode_audio
from easerve.models.tiny import cached_tiny
from easerve.pipeline import InProcessPipeline
from easerve.types import SamplingParams
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack, free_port
from tests.support.media import png_bytes, wav_bytes
from tests.support.prom import metric, scrape

pytestmark = pytest.mark.slow
N = 6
ONE = {"threads": 1}
CAPACITY = 16 * 1024          # bytes: 16 tiny-image embeddings (4 tokens x 64 x fp32 each)
PROMPT = "What is this?"


def _stack(model: str, cache_gb: float, n_encode: int) -> tuple[Stack, list[str]]:
    ports = [free_port() for _ in range(n_encode)]
    enc = tuple(Worker(flags={"max-batch": 4, "encoder-cache-gb": cache_gb, "metrics-listen": f"127.0.0.1:{p}",
                              **ONE}) for p in ports)
    d = Deployment(model=model, name=f"cache-{cache_gb}", encode=enc, prefill=(Worker(flags=ONE),),
                   decode=(Worker(flags={"num-slots": 8, **ONE}),)).with_gateway_ports(0, 0)
    d = d.with_flags("gateway", encoder_cache_affinity=8)  # 6 concurrent requests may all meet at one instance
    return Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"}), [f"http://127.0.0.1:{p}/metrics" for p in ports]


@pytest.fixture(scope="module")
def vl_model(tiny_root):
    return str(cached_tiny("qwen2.5-vl", tiny_root))


@pytest.fixture(scope="module")
def cache_on(vl_model):
    stack, metrics = _stack(vl_model, CAPACITY / 2**30, 2)
    stack.start(timeout=420)
    yield stack, metrics
    stack.stop()


@pytest.fixture(scope="module")
def cache_off(vl_model):
    stack, _ = _stack(vl_model, 0.0, 1)
    stack.start(timeout=420)
    yield stack
    stack.stop()


def _total(urls: list[str], name: str) -> float:
    return sum(metric(scrape(u), name) for u in urls)


def _gateway(stack, name: str) -> float:
    """A counter of the gateway's own /metrics (0 before it first counts)."""
    return metric(scrape(f"{stack.endpoints.http}/metrics"), name)


SKIPPED = "easerve:gateway_preprocess_skipped_total"
LATE = "easerve:gateway_encoder_cache_late_misses_total"


def _gen(stack, **kw):
    return Client(stack.endpoints.grpc, timeout=180).generate(PROMPT, max_tokens=N, **kw)


REQUESTS = {"image": {"images": [png_bytes(48, 64, 7)]},
            "video": {"video": [png_bytes(56, 56, 20 + i) for i in range(4)]},
            "two images": {"images": [png_bytes(56, 56, 8), png_bytes(48, 48, 9)]}}


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_greedy_tokens_equal_with_the_cache_on_and_off_and_a_repeat_skips_preprocessing(cache_on, cache_off, kind):
    stack, metrics = cache_on
    kw = REQUESTS[kind]
    off = _gen(cache_off, **kw)
    free_before = _total(metrics, "easerve:encoder_cache_pixel_free_items_total")
    skipped_before = _gateway(stack, SKIPPED)
    first, again = _gen(stack, **kw), _gen(stack, **kw)
    n_items = len(kw.get("images", [None]))
    assert list(first.token_ids) == list(again.token_ids) == list(off.token_ids)
    assert (off.timings.encode_cache_hits, first.timings.encode_cache_hits) == (0, 0)
    assert again.timings.encode_cache_hits == n_items and again.timings.encode_ms == 0, stack.log_tail("gateway", 60)
    assert _total(metrics, "easerve:encoder_cache_pixel_free_items_total") - free_before == n_items
    # the repeat was neither decoded nor run through the HF processor at the gateway
    assert (off.timings.preprocess_skipped, first.timings.preprocess_skipped, again.timings.preprocess_skipped) \
        == (False, False, True)
    assert first.timings.preprocess_ms > 0 and again.timings.preprocess_ms > 0
    assert _gateway(stack, SKIPPED) - skipped_before == 1 and _gateway(cache_off, SKIPPED) == 0


def test_a_raw_prompt_repeat_skips_preprocessing_too(cache_on):
    stack, _ = cache_on
    img = png_bytes(40, 40, 4242)
    raw = "<|vision_start|><|image_pad|><|vision_end|>Name it."
    first, again = (Client(stack.endpoints.grpc, timeout=180).generate(raw_prompt=raw, images=[img], max_tokens=N)
                    for _ in range(2))
    assert list(first.token_ids) == list(again.token_ids)
    assert (first.timings.preprocess_skipped, again.timings.preprocess_skipped) == (False, True)


def test_the_sdk_and_the_openai_api_share_entries(cache_on):
    from openai import OpenAI
    from tests.support.media import data_uri
    stack, metrics = cache_on
    raw = png_bytes(40, 56, 77)
    hits = _total(metrics, "easerve:encoder_cache_hits_total")
    sdk = _gen(stack, images=[raw])
    oa = OpenAI(base_url=stack.endpoints.openai_base_url, api_key="none", max_retries=0)
    http = oa.chat.completions.create(model=Path(stack.deployment.model).name, max_tokens=N, temperature=0.0,
                                      messages=[{"role": "user", "content": [
                                          {"type": "image_url", "image_url": {"url": data_uri(raw)}},
                                          {"type": "text", "text": PROMPT}]}])
    assert _total(metrics, "easerve:encoder_cache_hits_total") - hits == 1
    assert http.choices[0].message.content == sdk.text


def test_audio_greedy_tokens_equal_the_uncached_pipeline_and_a_repeat_hits(audio_stack):
    wav = wav_bytes(0.8, 330)
    pipe = InProcessPipeline(audio_stack.deployment.model)
    msgs = [{"role": "user", "content": [{"type": "audio", "audio": decode_audio(wav, target_rate=16000)},
                                         {"type": "text", "text": PROMPT}]}]
    want = pipe.run([(msgs, SamplingParams(max_tokens=N))])[0].token_ids
    first, again = _gen(audio_stack, audio=wav), _gen(audio_stack, audio=wav)
    assert list(first.token_ids) == list(again.token_ids) == list(want)
    assert (first.timings.encode_cache_hits, again.timings.encode_cache_hits) == (0, 1)
    assert (first.timings.preprocess_skipped, again.timings.preprocess_skipped) == (False, True)


def test_concurrent_requests_for_one_new_image_run_the_tower_once(cache_on):
    stack, metrics = cache_on
    before = _total(metrics, "easerve:encoder_cache_tower_items_total")
    img = png_bytes(64, 48, 1234)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: _gen(stack, images=[img]), range(6)))
    assert _total(metrics, "easerve:encoder_cache_tower_items_total") - before == 1
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert sorted(o.timings.encode_cache_hits for o in outs) == [0] + [1] * 5


def test_metrics_count_hits_misses_evictions_and_bytes_stay_within_the_bound(cache_on):
    stack, metrics = cache_on
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: _gen(stack, images=[png_bytes(48, 48, 500 + k)]), range(40)))
    scraped = [scrape(u) for u in metrics]
    assert sum(metric(s, "easerve:encoder_cache_evictions_total") for s in scraped) > 0
    assert sum(metric(s, "easerve:encoder_cache_misses_total") for s in scraped) >= 40
    assert sum(metric(s, "easerve:encoder_cache_hits_total") for s in scraped) > 0      # the earlier tests' repeats
    for s in scraped:  # an instance holds embeddings exactly when it computed some (a miss stores one), within the bound
        assert metric(s, "easerve:encoder_cache_capacity_bytes") == CAPACITY
        held, misses = metric(s, "easerve:encoder_cache_bytes"), metric(s, "easerve:encoder_cache_misses_total")
        assert held <= CAPACITY and (held > 0) == (misses > 0), (held, misses)


def test_a_monolith_caches_too_and_keeps_requests_on_the_instance_holding_the_reservation(vl_model, cache_off):
    from hasctl.deployment import preset
    d = preset("monolith").with_model(vl_model).with_gateway_ports(0, 0).with_flags("monolith", threads=1)
    mono = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    mono.start(timeout=420)
    try:
        kw = REQUESTS["image"]
        first, again = _gen(mono, **kw), _gen(mono, **kw)
    finally:
        mono.stop()
    assert list(first.token_ids) == list(again.token_ids) == list(_gen(cache_off, **kw).token_ids)
    assert (first.timings.encode_cache_hits, again.timings.encode_cache_hits) == (0, 1)


# ---- every family, late misses (monoliths: one process holds encode, prefill and decode) ----
def _monoliths(model: str, n: int, **flags) -> Stack:
    w = Worker(flags={"sm-backend": "timeslice", "partition-policy": "timeslice", **ONE, **flags})
    d = Deployment(model=model, name=f"mono-{n}", prefill=(), decode=(), monolith=(w,) * n).with_gateway_ports(0, 0)
    return Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})


@pytest.mark.parametrize("family", ["llava-next", "ultravox"])
def test_the_other_families_give_the_uncached_tokens_on_a_hit_that_skips_preprocessing(tiny_root, family):
    from easerve.media import decode_image
    model = str(cached_tiny(family, tiny_root))
    if family == "llava-next":
        raw = png_bytes(50, 70, 31)
        kw, part = {"images": [raw]}, {"type": "image", "image": decode_image(raw, 8192)}
    else:
        raw = wav_bytes(1.1, 440)
        kw, part = {"audio": raw}, {"type": "audio", "audio": decode_audio(raw, target_rate=16000)}
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": PROMPT}]}]
    want = InProcessPipeline(model).run([(msgs, SamplingParams(max_tokens=N))])[0].token_ids
    stack = _monoliths(model, 1)
    stack.start(timeout=420)
    try:
        first, again = _gen(stack, **kw), _gen(stack, **kw)
        skipped = _gateway(stack, SKIPPED)
    finally:
        stack.stop()
    assert list(first.token_ids) == list(again.token_ids) == list(want)
    assert (first.timings.encode_cache_hits, again.timings.encode_cache_hits) == (0, 1)
    assert (first.timings.preprocess_skipped, again.timings.preprocess_skipped, skipped) == (False, True, 1)


def test_a_late_miss_at_another_instance_is_preprocessed_in_full_and_resent(vl_model):
    """Two monoliths decoding one request at a time each. A repeat is planned at the one holding
    its image (hit: no preprocessing, no pixels); while that one's decode is busy with a long
    request, the next repeat's reservation lands on the other monolith, which does not hold the
    image: it answers a CacheMiss, and the gateway preprocesses and resends."""
    stack = _monoliths(vl_model, 2, max_running=1, max_waiting=0)
    stack.start(timeout=420)
    client = Client(stack.endpoints.grpc, timeout=180)
    img = png_bytes(44, 60, 99)
    try:
        first = client.generate(PROMPT, images=[img], max_tokens=N)
        with client.generate(PROMPT, images=[img], max_tokens=3000, ignore_eos=True, stream=True) as long:
            head = next(iter(long))               # a hit, decoding at the holder: its one slot is taken
            late = client.generate(PROMPT, images=[img], max_tokens=N)
        after = client.generate(PROMPT, images=[img], max_tokens=N)
        late_misses, skipped = _gateway(stack, LATE), _gateway(stack, SKIPPED)
    finally:
        client.close()
        stack.stop()
    assert head.timings.preprocess_skipped and head.timings.encode_cache_hits == 1
    assert list(late.token_ids) == list(first.token_ids) == list(after.token_ids)
    assert (late.timings.preprocess_skipped, late.timings.encode_cache_hits, late_misses) == (False, 0, 1)
    assert late.timings.preprocess_ms > 0
    assert after.timings.preprocess_skipped and skipped == 2   # the long request and the last one
