"""screen on hand-made profiles with a known bottleneck removes exactly the allocations it should."""
from __future__ import annotations

import json

import pytest

from hasctl.cli import main
from easerve.profile_format import dump
from hasctl.screen import Allocation, Demand, demand_from, enumerate_allocations, screen
from tests.support.profiles import make_profile


def names(verdicts, kept):
    return {v.allocation.name for v in verdicts if v.kept == kept}


def test_enumeration_over_four_devices():
    allocs = enumerate_allocations(4)
    assert {a.name for a in allocs} == {
        "E1-P1-D2", "E1-P2-D1", "E2-P1-D1",
        "E1-P0-D3+coloc", "E1-P1-D2+coloc", "E1-P2-D1+coloc", "E2-P0-D2+coloc", "E2-P1-D1+coloc", "E3-P0-D1+coloc"}
    assert all(a.encode + a.prefill + a.decode == 4 for a in allocs)
    assert Allocation(0, 3, 1) in enumerate_allocations(4, media=False)  # text-only needs no encode
    with pytest.raises(ValueError, match="devices must be >= 1"):
        enumerate_allocations(0)


def test_encode_bottleneck_and_colocated_prefill_starved_by_encode():
    # encode 10 items/s per instance, prefill 1000 tok/s, decode 2000 tok/s;
    # demand: 15 items/s, 750 prompt tok/s, 300 output tok/s
    v = screen(make_profile(encode_s_per_item=0.1), Demand(15, 1, 50, 20), devices=4)
    assert names(v, True) == {"E2-P1-D1", "E2-P1-D1+coloc", "E3-P0-D1+coloc"}
    removed = {x.allocation.name: x.reason for x in v if not x.kept}
    assert set(removed) == {"E1-P1-D2", "E1-P2-D1", "E1-P0-D3+coloc", "E1-P1-D2+coloc", "E1-P2-D1+coloc",
                            "E2-P0-D2+coloc"}
    assert removed["E1-P1-D2"] == "encode: capacity 10 items/s < demand 15 items/s"
    # two encoders are busy 75 % of the time: co-located prefill gets 2 x 1000 x 0.25 = 500 tok/s
    assert removed["E2-P0-D2+coloc"] == "prefill: capacity 500 tokens/s < demand 750 tokens/s"
    assert removed["E1-P0-D3+coloc"].startswith("encode: capacity 10 items/s < demand 15")
    assert "prefill: capacity 0 tokens/s" in removed["E1-P0-D3+coloc"]  # encode saturated: nothing left


def test_decode_bottleneck():
    v = screen(make_profile(encode_s_per_item=0.01), Demand(15, 1, 50, 200), devices=4)  # 3000 output tok/s
    assert names(v, True) == {"E1-P1-D2", "E1-P1-D2+coloc", "E1-P0-D3+coloc", "E2-P0-D2+coloc"}
    assert all(x.reason == "decode: capacity 2000 tokens/s < demand 3000 tokens/s" for x in v if not x.kept)
    # headroom: at 70 % utilization two decoders (2800) no longer carry 3000, one prefill (700)
    # not 750, and the co-located prefill beside one encoder (busy 15 %) gives 1000 x 0.85 x 0.7 = 595 < 750 tok/s
    tight = {x.allocation.name: x.reason for x in screen(make_profile(encode_s_per_item=0.01),
                                                          Demand(15, 1, 50, 200), 4, max_utilization=0.7)}
    assert tight["E1-P0-D3+coloc"] == "prefill: capacity 595 tokens/s < demand 750 tokens/s"
    assert tight["E1-P1-D2"] == ("prefill: capacity 700 tokens/s < demand 750 tokens/s; "
                                 "decode: capacity 2800 tokens/s < demand 3000 tokens/s")
    assert not names(screen(make_profile(encode_s_per_item=0.01), Demand(15, 1, 50, 200), 4,
                            max_utilization=0.7), True)


def test_video_costs_scale_encode_demand():
    prof = make_profile(encode_s_per_item=0.1)  # video: 3x an image -> 3.33 items/s per encoder
    d = demand_from(prof, 5.0, "video")
    assert (d.items, d.prompt_tokens, d.output_tokens, d.modality) == (1.0, 100, 20, "video")
    kept = names(screen(prof, d, 4), True)
    assert kept == {"E2-P1-D1", "E2-P1-D1+coloc", "E3-P0-D1+coloc"}  # 2 x 3.33 >= 5 > 3.33


def test_cli_prints_kept_and_removed_with_reasons(tmp_path, capsys):
    path = dump(make_profile(encode_s_per_item=0.1), tmp_path / "p.json")
    assert main(["screen", "--profile", str(path), "--rate", "15", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 4 and out["demand"]["prompt_tokens"] == 50  # from the image unloaded request
    assert {k["name"] for k in out["kept"]} == {"E2-P1-D1", "E2-P1-D1+coloc", "E3-P0-D1+coloc"}
    assert len(out["removed"]) == 6 and all(r["reason"] for r in out["removed"])
    assert main(["screen", "--profile", str(path), "--rate", "15", "--devices", "3"]) == 0
    text = capsys.readouterr().out
    assert "kept (" in text and "removed (" in text and "encode: capacity 10 items/s < demand 15" in text
    assert main(["screen", "--profile", str(path), "--rate", "15", "--devices", "1"]) == 2
    assert "1 device(s) hold no allocation" in capsys.readouterr().err
    assert main(["screen", "--profile", str(tmp_path / "none.json"), "--rate", "1"]) == 2
    assert "cannot read the profile" in capsys.readouterr().err


def test_decode_capacity_is_read_at_the_requests_context():
    import dataclasses

    from easerve.profile_format import DecodePoint
    p = make_profile(encode_s_per_item=0.01)  # decode: 2000 tok/s at context 128
    p = dataclasses.replace(p, decode=p.decode + tuple(DecodePoint(b, 2 * b / 2000, 1024) for b in (1, 8, 32)))
    short = screen(p, Demand(15, 1, 50, 100), 3)   # 1500 output tok/s at context ~100: one decoder carries it
    long = screen(p, Demand(15, 1, 900, 100), 3)   # context ~950: 1000 tok/s per decoder
    assert "E1-P1-D1" in names(short, True)
    assert {v.allocation.name: v.reason for v in long}["E1-P1-D1"].endswith(
        "decode: capacity 1000 tokens/s < demand 1500 tokens/s")


def test_request_at_a_time_is_screened_at_batch_one():
    import dataclasses
    from easerve.profile_format import EncodePoint
    prof = make_profile()  # 0.1 s per image alone; below, a batch of 4 takes 0.2 s (20 items/s)
    grid = tuple(EncodePoint(b, 1.0, 0.1 * (1 + (b - 1) / 3)) for b in (1, 2, 4))
    prof = dataclasses.replace(prof, encode=dataclasses.replace(prof.encode, grid=grid))
    demand = Demand(15, 1, 10, 10)
    e1 = Allocation(1, 1, 2)
    assert [v.kept for v in screen(prof, demand, 4) if v.allocation == e1] == [True]
    for mode, kept in (("continuous", True), ("fixed", True), ("request_at_a_time", False)):
        (v,) = [v for v in screen(prof, demand, 4, batch_mode=mode) if v.allocation == e1]
        assert v.kept == kept, mode
    (v,) = [v for v in screen(prof, demand, 4, batch_mode="request_at_a_time") if v.allocation == e1]
    assert v.reason == "encode: capacity 10 items/s < demand 15 items/s"
    with pytest.raises(ValueError, match="batch mode must be one of"):
        screen(prof, demand, 4, batch_mode="greedy")
