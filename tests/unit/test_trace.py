import pytest

from easerve.stages.encode.trace import UtilizationTrace


def test_utilization_is_share_weighted_overlap_within_the_window():
    t = UtilizationTrace()
    t.record("encode", 0.0, 1.0, share=0.6)
    t.record("prefill", 0.5, 2.0, share=0.4)
    assert t.utilization("encode", 0.0, 2.0) == pytest.approx(0.3)
    assert t.utilization("encode", 0.0, 2.0, weighted=False) == pytest.approx(0.5)
    assert t.utilization("prefill", 1.0, 2.0) == pytest.approx(0.4)
    series = t.buckets(0.0, 2.0, 1.0)
    assert [b["t"] for b in series] == [0.0, 1.0]
    assert series[0]["encode"] == pytest.approx(0.6) and series[1]["encode"] == 0
    assert series[0]["prefill"] == pytest.approx(0.2)


def test_bounded_and_validated():
    t = UtilizationTrace(maxlen=2)
    for i in range(5):
        t.record("encode", i, i + 0.5)
    assert [s.start for s in t.spans()] == [3, 4]
    with pytest.raises(ValueError, match="before it starts"):
        t.record("encode", 2.0, 1.0)
    with pytest.raises(ValueError):
        t.buckets(0, 1, 0)
