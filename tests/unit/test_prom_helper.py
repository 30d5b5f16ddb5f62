"""tests.support.prom.metric reads a real registry's exposition: by sample name and label subset."""
from __future__ import annotations

from prometheus_client import generate_latest

from easerve.stages.encode.metrics import EncodeMetrics
from tests.support.prom import metric


def test_metric_sums_samples_by_name_and_labels():
    m = EncodeMetrics(0.5)
    for route in ("local", "remote", "remote"):
        m.on_route(route)
    text = generate_latest(m.registry).decode()
    assert metric(text, "easerve:encode_routed_total", route="remote") == 2
    assert metric(text, "easerve:encode_routed_total") == 3
    assert metric(text, "easerve:encode_remote_fraction_target") == 0.5
    assert metric(text, "easerve:encode_routed_total", route="elsewhere") == 0
    assert metric(text, "easerve:encode_routed") == 0  # exposed names only (counters end in _total)
