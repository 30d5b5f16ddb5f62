"""Where a simulated request's time to its first token went, in the phases the live gateway
reports per request (easerve:stage_latency_seconds, easerve/stages/gateway/core.py): its
preprocessing (from being taken off the gateway's queue to its prompt being ready), the encode
queue (arrival at the encode instance to its batch's start), the encode batch, the prefill batch,
and the time to first token from arrival. The stages mark each request (`Req.mark`) as it crosses
a boundary; `means_ms` averages each phase over the requests that crossed both of its ends.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable

from easerve.sim.workload import Req

PHASES: dict[str, tuple[str, str]] = {
    "preprocess": ("taken", "preprocessed"),
    "queue": ("encode_in", "encode_start"),
    "encode": ("encode_start", "encode_end"),
    "prefill": ("prefill_start", "prefill_end"),
}


def means_ms(reqs: Iterable[Req]) -> dict[str, float]:
    """Phase -> mean milliseconds over the requests that crossed both of its ends, and "ttft",
    arrival to first token over those that had one (a phase no request crossed is left out)."""
    reqs = list(reqs)
    out = {}
    for phase, (a, b) in PHASES.items():
        vals = [r.marks[b] - r.marks[a] for r in reqs if a in r.marks and b in r.marks]
        if vals:
            out[phase] = round(statistics.fmean(vals) * 1e3, 2)
    ttft = [r.tokens[0] - r.spec.arrival_s for r in reqs if r.tokens and r.error is None]
    if ttft:
        out["ttft"] = round(statistics.fmean(ttft) * 1e3, 2)
    return out
