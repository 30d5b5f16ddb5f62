"""The profile file: round trip, validation that names the field, and the lookups a simulator uses."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hasctl.profile_format import FORMAT, DecodePoint, Profile, dump, load
from tests.profiles import make_profile


def test_round_trip_keeps_every_field(tmp_path):
    p = make_profile()
    path = dump(p, tmp_path / "p.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == FORMAT == "easerve.profile/v1"
    assert load(path) == p


def test_lookups_give_service_times_and_capacities():
    p = make_profile(encode_s_per_item=0.1, prefill_tok_s=1000, decode_tok_s=2000)
    assert p.encode_latency(2) == pytest.approx(0.2)
    assert p.encode_latency(3) == pytest.approx(0.3)           # between measured batches
    assert p.encode_latency(8) == pytest.approx(0.8)           # beyond: along the last segment
    assert p.encode_latency(2, share=0.5) == pytest.approx(0.3)
    assert p.encode_latency(2, share=0.3) == pytest.approx(0.3)  # the smallest level >= 0.3
    assert p.encode_latency(2, modality="video") == pytest.approx(0.6)
    assert p.encode_capacity() == pytest.approx(10.0)
    assert p.encode_capacity(modality="video") == pytest.approx(10 / 3)
    assert p.prefill_latency(64, 1) == pytest.approx(0.064)
    assert p.prefill_latency(40, 2) == pytest.approx(0.080)
    assert p.prefill_capacity(100) == pytest.approx(1000)
    assert p.decode_step_s(16) == pytest.approx(16 / 2000)
    assert p.decode_capacity(max_batch=8) == pytest.approx(2000)
    # a second measured context: lookups take the points of the nearest one
    long = dataclasses.replace(p, decode=p.decode + tuple(DecodePoint(b, 2 * b / 2000, 1024) for b in (1, 8)))
    assert long.decode_step_s(4) == pytest.approx(4 / 2000)  # default: the smallest context (128)
    assert long.decode_step_s(4, context_len=900) == pytest.approx(8 / 2000)
    assert long.decode_capacity(context_len=2000) == pytest.approx(1000)
    slo = p.slo("moderate")
    assert slo.limits("image") == pytest.approx((0.2 * 4e3, 0.01 * 4e3))
    assert slo.limits("text") == pytest.approx((0.05 * 4e3, 0.01 * 4e3))


def test_validation_names_the_field_and_what_to_change(tmp_path):
    raw = make_profile().to_dict()
    bad = json.loads(json.dumps(raw))
    bad["encode"]["grid"][2]["latency_s"] = -1
    with pytest.raises(ValueError, match=r"encode.grid\[2\].latency_s must be a finite number > 0.*re-run"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    bad["decode"][0]["batch"] = 3
    with pytest.raises(ValueError, match=r"decode\[0\]: unknown key\(s\) \['batch'\]"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    del bad["hardware"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['hardware'\]"):
        Profile.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    bad["prefill"][0]["prompt_len"] = "64"
    with pytest.raises(ValueError, match=r"prefill\[0\].prompt_len must be a int"):
        Profile.from_dict(bad)
    with pytest.raises(ValueError, match="not a easerve.profile/v1 profile"):
        Profile.from_dict({**raw, "format": "easerve.profile/v0"})
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="x.json is not valid JSON"):
        load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown SLO tier"):
        make_profile().slo("strict")


def test_revision_2_sections_round_trip_and_revision_1_still_loads(tmp_path):
    from hasctl.profile_format import GatewayPoint, Interference, LinkPoint, Transfer
    old = make_profile()
    raw = json.loads(json.dumps(old.to_dict()))
    for k in ("revision", "gateway", "transfer", "interference"):
        raw.pop(k)
    v1 = Profile.from_dict(raw)  # a file written before revision 2
    assert v1.revision == 1 and v1.gateway_latency("image", "224x224") == 0.0
    assert v1.link("same_host") is None and v1.slowdown("encode", "prefill") == 1.0
    new = dataclasses.replace(old, revision=2, gateway=(GatewayPoint("image", "224x224", 0.02),
                                                        GatewayPoint("image", "448x448", 0.06)),
                              transfer=Transfer(4096, 16384, (LinkPoint("same_host", 8.0, 1e-4),
                                                              LinkPoint("other_host", 12.5, 5e-5, measured=False))),
                              interference=(Interference("encode", "prefill", 1.7),))
    back = load(dump(new, tmp_path / "p.json"))
    assert back == new
    assert back.gateway_latency("image", "224x224") == 0.02 and back.gateway_latency("image", "1x1") == 0.04
    assert back.link("same_host").gb_per_s == 8.0 and back.slowdown("encode", "prefill") == 1.7
    bad = json.loads(json.dumps(back.to_dict()))
    bad["transfer"]["links"][0]["kind"] = "carrier_pigeon"
    with pytest.raises(ValueError, match=r"transfer.links\[0\].kind"):
        Profile.from_dict(bad)
