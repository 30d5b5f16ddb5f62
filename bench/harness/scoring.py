"""How a bench scores its replies: easerve.slo.compute_metrics against the bench's limits, its
figures picked under the names its JSON has always used, and the SLO it derives from unloaded
latency."""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from easerve.slo import SLO, RequestRecord, compute_metrics

# compute_metrics' names -> what the live benches call them
COMMON = {"p50_ttft_ms": "median_ttft_ms", "p99_ttft_ms": "p99_ttft_ms", "p50_tpot_ms": "median_tpot_ms",
          "goodput_rps": "request_goodput", "throughput_rps": "request_throughput", "completed": "completed",
          "failed": "failed", "slo_attainment": "slo_attainment"}


def metrics(records: Sequence[RequestRecord], limits_ms: tuple[float, float], wall_s: float | None = None) -> dict:
    """compute_metrics over the records, goodput against (TTFT ms, TPOT ms), per second of
    wall_s (None: first arrival to last end)."""
    return compute_metrics(records, SLO(*limits_ms), duration_s=wall_s)


def summary(records: Sequence[RequestRecord], limits_ms: tuple[float, float], keys: Sequence[str],
            wall_s: float | None = None, names: Mapping[str, str] = COMMON) -> dict:
    """The figures `keys` (COMMON's names, or compute_metrics' own) of a run, plus wall_s."""
    m = metrics(records, limits_ms, wall_s)
    out = {k: m[names.get(k, k)] for k in keys}
    return out | ({"wall_s": wall_s} if wall_s is not None else {})


REFUSALS = ("goodput_rps", "throughput_rps", "completed", "failed", "p50_ttft_ms", "slo_attainment")


def summary_with_refusals(records: Sequence[RequestRecord], limits_ms: tuple[float, float], wall_s: float) -> dict:
    """summary() of a run against a gateway that may refuse (429): REFUSALS, wall_s and "refused"
    ("failed" counts the other failures only)."""
    out, n = summary(records, limits_ms, REFUSALS, wall_s), refused(records)
    return out | {"failed": out["failed"] - n, "refused": n}


def met(r: RequestRecord, limits_ms: tuple[float, float]) -> bool:
    return SLO(*limits_ms).met(r)


def refused(records: Sequence[RequestRecord]) -> int:
    return sum(r.error_kind == "http_429" for r in records)


def unloaded_limits(records: Sequence[RequestRecord], mult: float) -> tuple[float, float]:
    """SLO (TTFT ms, TPOT ms) = mult x the median TTFT / TPOT of requests sent one at a time
    (TPOT at least 1 ms)."""
    ok = [r for r in records if r.ok]
    if not ok:
        raise RuntimeError(f"no unloaded request completed: {[r.error for r in records]}")
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None] or [0.0]
    return (mult * 1e3 * statistics.median(r.ttft_s for r in ok),
            mult * 1e3 * max(statistics.median(tpots), 1e-3))


def ratio(a: float | None, b: float | None, digits: int | None = None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or not b:
        return None
    return a / b if digits is None else round(a / b, digits)


def report_row(label: str, rate: float, records: Sequence[RequestRecord], limits_ms: tuple[float, float],
               wall_s: float | None = None) -> dict:
    """One run as `hasctl report` reads a `hasctl bench` result: label, rate, the metrics, the SLO
    and the per-request records."""
    return {"label": label, "request_rate": rate, **metrics(records, limits_ms, wall_s),
            "slo": {"ttft_ms": limits_ms[0], "tpot_ms": limits_ms[1]}, "records": [r.to_dict() for r in records]}
