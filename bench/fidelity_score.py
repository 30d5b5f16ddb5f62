"""Scoring of bench/sim_fidelity.py: the steady-state figures of a run's request records, the
live interval of a cell over its repeats, and where the simulated value lies against it.

Records are `easerve.slo.RequestRecord`s (live: `hasctl bench`; simulated: `hasctl simulate`,
the same fields). Pure: no stack, no simulator.

- `steady_goodput`: the cell's rate x the share of the requests that arrived in the steady
  window (the first and last `TRIM` of the arrival span dropped) and met the SLO.
- `steady_capacity`: completions that ended in the steady window of an overloaded run, per
  second of that window.
- `interval`: a two-level bootstrap 95 % interval of the mean goodput over a cell's live
  repeats (repeats drawn with replacement, then each one's steady requests), so it carries both
  the noise between runs and within one.
- `score_cell`: inside the interval widened by `WIDEN` (5 %) or not, the bias log(sim / live
  mean) and the excess error (how far outside the widened interval, in log terms).
- `rank_separable`: over deployment pairs whose live intervals do not overlap, the share the
  other side (the simulator, or a left-out live repeat) puts in the same order.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

TRIM = 0.15          # share of a run dropped at each end (warm-up and drain)
WIDEN = 0.05         # the live interval widened by this share on each side before scoring
BOOTSTRAP = 2000     # resamples of the interval
EPS_RPS = 1e-3       # floor of a goodput inside a log ratio


def window(records: Sequence, trim: float = TRIM) -> tuple[float, float]:
    """(start, end) of the steady part of the arrival span."""
    t = sorted(r.scheduled_s for r in records)
    if not t:
        return 0.0, 0.0
    span = t[-1] - t[0]
    return t[0] + trim * span, t[-1] - trim * span


def steady_outcomes(records: Sequence, slo) -> list[bool]:
    """Met the SLO (completed, TTFT and TPOT within the tier), per request arrived in the steady window."""
    lo, hi = window(records)
    return [bool(r.ok and slo.met(r)) for r in records if lo <= r.scheduled_s <= hi]


def steady_goodput(records: Sequence, slo, rate: float) -> float:
    met = steady_outcomes(records, slo)
    return rate * sum(met) / len(met) if met else 0.0


def steady_capacity(records: Sequence) -> float:
    """Requests per second that ended (completed) within the steady window of the run's arrivals."""
    lo, hi = window(records)
    if hi <= lo:
        return 0.0
    ends = [r.end_s for r in records if r.ok and r.end_s is not None and lo <= r.end_s <= hi]
    return len(ends) / (hi - lo)


def interval(outcomes: Sequence[Sequence[bool]], rate: float, n: int = BOOTSTRAP, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of rate x attainment over repeats (each a list of steady outcomes)."""
    reps = [list(o) for o in outcomes if o]
    if not reps:
        return 0.0, 0.0, 0.0
    mean = statistics.fmean(rate * sum(o) / len(o) for o in reps)
    rng, draws = random.Random(seed), []
    for _ in range(n):
        picked = [reps[rng.randrange(len(reps))] for _ in reps]
        draws.append(statistics.fmean(rate * sum(rng.choices(o, k=len(o))) / len(o) for o in picked))
    draws.sort()
    a = (1.0 - level) / 2
    return mean, draws[int(a * (n - 1))], draws[int((1 - a) * (n - 1))]


def log_ratio(a: float, b: float, floor: float = EPS_RPS) -> float:
    return math.log(max(a, floor) / max(b, floor))


def score_cell(sim: float, mean: float, lo: float, hi: float, widen: float = WIDEN) -> dict:
    """Where `sim` lies against the live interval [lo, hi] widened by `widen`."""
    wlo, whi = lo * (1 - widen), hi * (1 + widen)
    inside = wlo <= sim <= whi
    excess = 0.0 if inside else (log_ratio(wlo, sim) if sim < wlo else log_ratio(sim, whi))
    return {"inside": inside, "bias": round(log_ratio(sim, mean), 4), "excess": round(abs(excess), 4)}


def leave_one_out(outcomes: Sequence[Sequence[bool]], rate: float, seed: int = 0) -> list[dict]:
    """Each live repeat scored as `score_cell` scores the simulator, against the interval of the
    others: the same figures for live against live (the noise a perfect simulator still shows)."""
    out = []
    for k, o in enumerate(outcomes):
        rest = [x for j, x in enumerate(outcomes) if j != k]
        if not rest or not o:
            continue
        mean, lo, hi = interval(rest, rate, seed=seed + k)
        out.append(score_cell(rate * sum(o) / len(o), mean, lo, hi))
    return out


def rank_separable(cells: dict[str, dict], other: str) -> tuple[int, int]:
    """(agreeing, separable) over pairs of `cells` ({deployment: {"lo", "hi", "mean", other: value}})
    whose live intervals do not overlap."""
    names, agree, total = sorted(cells), 0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = cells[a], cells[b]
            if ca.get(other) is None or cb.get(other) is None or not (ca["hi"] < cb["lo"] or cb["hi"] < ca["lo"]):
                continue
            total += 1
            agree += (ca["mean"] > cb["mean"]) == (ca[other] > cb[other])
    return agree, total


def mean_phases(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Phase -> the mean over runs of each run's mean milliseconds (phases every run has)."""
    common = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {p: round(statistics.fmean(r[p] for r in runs), 2) for p in sorted(common)}


def phase_bias(pairs: Sequence[tuple[dict[str, float], dict[str, float]]]) -> dict[str, float]:
    """Phase -> the median over (sim, live) pairs of log(sim / live), where both have it and
    the live mean is over 0.1 ms (> 0: the simulator's phase is longer than live)."""
    out: dict[str, list[float]] = {}
    for sim, live in pairs:
        for phase, ms in live.items():
            if ms > 0.1 and sim.get(phase, 0.0) > 0.0:
                out.setdefault(phase, []).append(math.log(sim[phase] / ms))
    return {p: round(statistics.median(v), 4) for p, v in sorted(out.items())}


def median_abs(values: Sequence[float]) -> float | None:
    vals = [abs(v) for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def attribute(service_err: dict[str, float | None], replay_err: float | None, coverage: float | None,
              service_target: float = 0.10, replay_target: float = 0.15) -> str:
    """Where a miss comes from: "service time" when a stage's call times are off the profile's,
    else "queueing" when the replay with measured call times misses TTFT, else "policy" (what
    the instances decide: placement, batching, admission), "none" when coverage is met."""
    if coverage is not None and coverage >= 0.8:
        return "none"
    bad = {s: e for s, e in service_err.items() if e is not None and e > service_target}
    if bad:
        return "service time (" + ", ".join(f"{s} {e:.2f}" for s, e in sorted(bad.items())) + ")"
    if replay_err is not None and replay_err > replay_target:
        return f"queueing (replay TTFT p50 error {replay_err:.2f})"
    return "policy"
