"""Arrival processes pass a Kolmogorov-Smirnov test at the seeded rate; synthetic requests are
what the gateway accepts; dataset replay reads its documented format and names bad lines."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hasctl.workload import WorkloadSpec, arrival_times, load_dataset, synthesize
from easerve.stages.gateway.openai_api import convert_part

N = 4000
KS_CRIT_1PCT = 1.628  # asymptotic Kolmogorov critical value at alpha = 0.01, times 1/sqrt(n)


def ks_statistic(samples, cdf) -> float:
    x = np.sort(np.asarray(samples))
    f = np.array([cdf(v) for v in x])
    n = len(x)
    return float(max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max()))


def gamma_cdf(x: float, shape: float, scale: float) -> float:
    """Regularized lower incomplete gamma P(shape, x/scale), by its power series."""
    z = x / scale
    if z <= 0:
        return 0.0
    term = total = 1.0 / shape
    for k in range(1, 2000):
        term *= z / (shape + k)
        total += term
        if term < 1e-15 * total:
            break
    return min(1.0, math.exp(shape * math.log(z) - z - math.lgamma(shape)) * total)


def intervals(rate, k, seed):
    return np.diff(arrival_times(rate, k, seed, n=N + 1))


@pytest.mark.parametrize("rate,k", [(5.0, 1.0), (5.0, 0.5), (2.0, 4.0), (40.0, 0.25)])
def test_gaps_fit_gamma_of_shape_k_and_mean_one_over_rate(rate, k):
    gaps = intervals(rate, k, seed=7)
    d = ks_statistic(gaps, lambda v: gamma_cdf(v, k, 1.0 / (rate * k)))
    assert d < KS_CRIT_1PCT / math.sqrt(N), (d, rate, k)
    assert abs(gaps.mean() * rate - 1.0) < 0.1


def test_poisson_gaps_are_exponential_and_the_ks_test_has_power():
    gaps = intervals(5.0, 1.0, seed=3)
    crit = KS_CRIT_1PCT / math.sqrt(N)
    assert ks_statistic(gaps, lambda v: 1 - math.exp(-5.0 * v)) < crit
    assert ks_statistic(gaps, lambda v: 1 - math.exp(-6.0 * v)) > crit  # wrong rate: rejected
    assert ks_statistic(intervals(5.0, 0.5, 3), lambda v: 1 - math.exp(-5.0 * v)) > crit  # bursty != Poisson


def test_arrivals_are_seeded_and_bounded():
    a = arrival_times(3.0, 0.5, seed=1, n=50)
    assert a == arrival_times(3.0, 0.5, seed=1, n=50) and a != arrival_times(3.0, 0.5, seed=2, n=50)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    d = arrival_times(3.0, 1.0, seed=1, duration_s=10.0)
    assert d and max(d) < 10.0 and 10 < len(d) < 60
    with pytest.raises(ValueError, match="exactly one"):
        arrival_times(3.0, n=5, duration_s=2.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3.0, 0.0, n=5)


def _decoded(parts: list) -> list:
    """What the gateway's media resolver makes of converted parts (text parts as they are)."""
    import asyncio

    from easerve.media import MediaConfig, MediaResolver
    from easerve.types import MediaPart
    media = [p for p in parts if isinstance(p, MediaPart)]
    it = iter(asyncio.run(MediaResolver(MediaConfig(audio_rate=16000)).resolve(media)))
    return [next(it) if isinstance(p, MediaPart) else p for p in parts]


def test_synthetic_requests_decode_like_the_gateway_decodes_them():
    spec = WorkloadSpec(modality="mixed", image_size=(64, 48), video_frames=3, video_size=(32, 32),
                        audio_s=0.5, input_tokens=20, mix=("image", "video", "audio", "text"))
    reqs = synthesize(spec, 24, seed=5)
    assert {r.modality for r in reqs} == {"image", "video", "audio", "text"}
    for r in reqs:
        parts = _decoded([convert_part(p, ("image", "video", "audio"), 16000) for p in r.messages[0]["content"]])
        kinds = [getattr(p, "kind", "text") for p in parts]
        assert kinds[-1] == "text" and len(parts[-1].text.split()) == 20
        if r.modality == "image":
            assert parts[0].value.size == (64, 48)
        elif r.modality == "video":
            assert len(parts[0].value) == 3 and parts[0].value[0].size == (32, 32)
        elif r.modality == "audio":
            assert len(parts[0].value) == 8000
        else:
            assert kinds == ["text"]
    images = [r.messages[0]["content"][0]["image_url"]["url"] for r in reqs if r.modality == "image"]
    assert len(set(images)) == len(images)  # unique media: no server-side cache hit
    frames = synthesize(WorkloadSpec(modality="video", video_format="frames", video_frames=2), 1)[0]
    assert len(_decoded([convert_part(frames.messages[0]["content"][0], ("video",), None)])[0].value) == 2


def test_body_is_a_streamed_chat_request():
    r = synthesize(WorkloadSpec(modality="text", output_tokens=7), 1)[0]
    b = r.body("m", ignore_eos=True)
    assert b["stream"] and b["stream_options"] == {"include_usage": True}
    assert b["max_tokens"] == 7 and b["ignore_eos"] is True and b["model"] == "m"
    assert "ignore_eos" not in r.body("m")


def test_dataset_replay(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([
        json.dumps({"prompt": "hello there", "max_tokens": 5}),
        "# a comment",
        "",
        json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "what"}]}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "modality": "long-text"}),
    ]))
    reqs = load_dataset(p, default_max_tokens=9)
    assert [(r.index, r.modality, r.max_tokens) for r in reqs] == [(0, "text", 5), (1, "image", 9),
                                                                    (2, "long-text", 9)]
    assert reqs[0].messages == ({"role": "user", "content": "hello there"},)
    p.write_text('{"prompt": "ok"}\n{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: give 'messages'"):
        load_dataset(p)
    p.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        load_dataset(p)


def test_spec_validation_says_what_to_change():
    with pytest.raises(ValueError, match="modality must be one of"):
        WorkloadSpec(modality="smell")
    with pytest.raises(ValueError, match="image_size"):
        WorkloadSpec(image_size=(0, 10))
    with pytest.raises(ValueError, match="mix must name"):
        WorkloadSpec(modality="mixed", mix=("image", "3d"))


def test_a_content_seed_gives_new_media_and_text_with_the_same_modality_mix():
    spec = WorkloadSpec(modality="mixed", image_size=(16, 16), video_frames=1, video_size=(16, 16), audio_s=0.1,
                        input_tokens=6, mix=("image", "audio", "text"))
    base, again, fresh = synthesize(spec, 12, seed=3), synthesize(spec, 12, seed=3), \
        synthesize(spec, 12, seed=3, content_seed=77)
    assert [r.messages for r in base] == [r.messages for r in again]
    assert [r.modality for r in fresh] == [r.modality for r in base]
    for a, b in zip(base, fresh):   # every part differs: no cache (media or prefix) can serve one for the other
        assert all(pa != pb for pa, pb in zip(a.messages[0]["content"], b.messages[0]["content"]))
