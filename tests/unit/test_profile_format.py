"""The profile file: round trip, validation that names the field, and the lookups a simulator uses."""
from __future__ import annotations

import dataclasses
import json

import pytest

from easerve.profile_format import FORMAT, DecodePoint, Profile, dump, load
from tests.support.profiles import make_profile


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


def _raw() -> dict:
    return json.loads(json.dumps(make_profile().to_dict()))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["encode"]["grid"][2].update(latency_s=-1),
     r"^encode.grid\[2\].latency_s: must be greater than 0, got -1; re-run hasctl profile$"),
    (lambda d: d["encode"]["grid"][0].update(latency_s=float("inf")), r"encode.grid\[0\].latency_s: must be a finite"),
    (lambda d: d["encode"]["grid"][1].update(share=1.5), r"encode.grid\[1\].share: must be less than or equal to 1"),
    (lambda d: d["decode"][0].update(batch=3), r"^decode\[0\]: unknown key 'batch'"),
    (lambda d: d.pop("hardware"), r"^profile: missing key 'hardware'"),
    (lambda d: d["unloaded"][1].pop("ttft_s"), r"^unloaded\[1\]: missing key 'ttft_s'"),
    (lambda d: d["prefill"][0].update(prompt_len="64"), r"prefill\[0\].prompt_len: must be a valid integer, got '64'"),
    (lambda d: d["prefill"][0].update(batch_size=True), r"prefill\[0\].batch_size: must be a valid integer"),
    (lambda d: d.update(quick=1), r"quick: must be a valid boolean"),
    (lambda d: d["encode"].update(grid=[p for p in d["encode"]["grid"] if p["share"] != 1.0]),
     r"^encode: grid has no share 1.0 point"),
    (lambda d: d.update(tiers=d["tiers"][:2]), r"tiers must be exactly \['tight', 'moderate', 'loose'\]"),
    (lambda d: d.update(decode=[]), r"^decode is empty; re-run hasctl profile"),
    (lambda d: d.update(scope="partial"), r"scope: must be 'full' or 'encode'"),
])
def test_validation_names_the_field_and_what_to_change(mutate, match):
    bad = _raw()
    mutate(bad)
    with pytest.raises(ValueError, match=match):
        Profile.from_dict(bad)


def test_wrong_files_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="not a easerve.profile/v1 profile"):
        Profile.from_dict({**_raw(), "format": "easerve.profile/v0"})
    old = {"format": "easerve.sm_profile", "version": 1, "device": "", "batch_sizes": [1], "shares": [1.0],
           "latency_s": [[0.1]]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old.json: this is an easerve.sm_profile file.*delete it.*hasctl profile"):
        load(tmp_path / "old.json", require="encode")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="x.json is not valid JSON"):
        load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown SLO tier"):
        make_profile().slo("strict")


def test_a_profile_written_before_pydantic_still_loads(tmp_path):
    """A file as the hand-written loader wrote it (keys in its order, ints where floats go)."""
    raw = _raw()
    raw["encode"]["grid"][0]["latency_s"] = 1  # an int where a float is: JSON allows it
    (tmp_path / "v1.json").write_text(json.dumps(raw))
    p = load(tmp_path / "v1.json")
    assert p.scope == "full" and p.encode.grid[0].latency_s == 1.0 and isinstance(p.encode.grid[0].latency_s, float)


def test_encode_scope_holds_the_encode_grid_alone(tmp_path):
    full = make_profile()
    part = Profile(full.hardware, full.versions, full.model, full.encode, scope="encode")
    path = dump(part, tmp_path / "enc.json")
    assert load(path, require="encode") == part
    with pytest.raises(ValueError, match=r"enc.json holds the encode grid alone .*write one with hasctl profile"):
        load(path)  # screen, bench and tune need every stage
    assert load(dump(full, tmp_path / "full.json"), require="encode").encode == full.encode
    with pytest.raises(ValueError, match="scope 'encode' needs the encode stage"):
        Profile(full.hardware, full.versions, full.model, None, scope="encode")


def test_constructors_validate_too():
    with pytest.raises(ValueError, match="greater than 0"):
        DecodePoint(4, 0.0)
    with pytest.raises(ValueError, match="greater than 0"):
        dataclasses.replace(make_profile().decode[0], step_s=-1.0)


def test_revision_2_sections_round_trip_and_revision_1_still_loads(tmp_path):
    from easerve.profile_format import GatewayPoint, Interference, LinkPoint, Transfer
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


def test_revision_4_sharing_curve_round_trips_interpolates_and_older_files_have_none(tmp_path):
    from easerve.profile_format import SharingPoint
    old = make_profile()
    assert old.sharing == () and old.sharing_slowdown("decode", "prefill", 2) is None
    pts = (SharingPoint("decode", "prefill", 1, 1.4, 2), SharingPoint("decode", "prefill", 2, 2.0, 2),
           SharingPoint("decode", "decode", 1, 1.2, 2), SharingPoint("prefill", "prefill", 1, 1.9, 2))
    new = load(dump(dataclasses.replace(old, revision=4, sharing=pts), tmp_path / "p.json"))
    assert new.sharing == pts
    assert new.sharing_slowdown("decode", "prefill", 0) == 1.0
    assert new.sharing_slowdown("decode", "prefill", 1) == pytest.approx(1.4)
    assert new.sharing_slowdown("decode", "prefill", 3) == pytest.approx(2.6)   # along the last segment
    assert new.sharing_slowdown("decode", "decode", 2) == pytest.approx(1.4)    # (0, 1) -> (1, 1.2) extended
    assert new.sharing_slowdown("decode", "encode", 1) == pytest.approx(1.3)    # unmeasured neighbour: mean at k
    assert new.sharing_slowdown("encode", "decode", 1) == pytest.approx((1.4 + 1.2 + 1.9) / 3)
    raw = json.loads(json.dumps(new.to_dict()))
    raw["sharing"][0]["busy"] = 0
    with pytest.raises(ValueError, match=r"sharing\[0\].busy"):
        Profile.from_dict(raw)


def test_revision_6_shared_env_round_trips_and_older_files_cost_nothing(tmp_path):
    from easerve.profile_format import SharedEnvPoint
    old = make_profile()
    assert old.shared_env == () and old.shared_env_slowdown("decode") == 1.0
    pts = (SharedEnvPoint("encode", 1.32), SharedEnvPoint("decode", 1.7))
    new = load(dump(dataclasses.replace(old, revision=6, shared_env=pts), tmp_path / "p.json"))
    assert new.shared_env == pts
    assert (new.shared_env_slowdown("encode"), new.shared_env_slowdown("decode")) == (1.32, 1.7)
    assert new.shared_env_slowdown("prefill") == 1.0   # not measured
    raw = json.loads(json.dumps(new.to_dict()))
    raw["shared_env"][0]["slowdown"] = 0
    with pytest.raises(ValueError, match=r"shared_env\[0\].slowdown"):
        Profile.from_dict(raw)
