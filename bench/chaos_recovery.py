"""How fast bench/chaos.py's stack is back after a kill: per kill, and averaged over the kills.

Both runs of the soak (clean, faults) replay the same seeded arrivals, so for every whole second
of the run there is a count of requests that met the SLO in each (`good_per_s`).

- `recovery_s`: per kill, seconds until the goodput of the next window is within 10 % of the clean
  run's mean (the issue's figure). At 2x load on 2 cores the goodput of a few seconds varies by
  more than 10 % with no fault at all, so its p99 is mostly noise: chaos.py scores the clean run
  at the same instants beside it.
- `epoch_recovery`: the kills superposed (each kill's seconds counted from it), so that the noise
  of one window averages out over the kills: at each offset after the kill, the good completions
  of the fault run over those of the clean run at the same instants, summed over the kills; the
  first offset from which that ratio stays within `fraction` of 1 up to the horizon (the next
  kill), with a bootstrap 95 % interval over the kills. A ratio that stays low through the whole
  cycle is a lasting loss (bias), not a slow recovery; a wide interval is noise.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def good_per_s(ends: Iterable[float], duration_s: float, tail_s: float = 15.0) -> np.ndarray:
    """Requests per whole second of the run by their end time (the ends of the requests that met
    the SLO), over duration_s + tail_s seconds (the later ones in the last second)."""
    per_s = np.zeros(int(duration_s + tail_s) + 1)
    for t in ends:
        per_s[min(int(t), len(per_s) - 1)] += 1
    return per_s


def window_mean(per_s: np.ndarray, window_s: int) -> np.ndarray:
    """At each second, the mean of the window_s seconds starting there (what the stack delivers
    from then on: a trailing window would still hold the dip itself)."""
    w = max(1, int(window_s))
    return np.convolve(per_s, np.ones(w) / w)[w - 1: w - 1 + len(per_s)]


def recovery_s(series: np.ndarray, target: float, kills: Sequence[float], fraction: float = 0.9) -> list[float]:
    """Per kill: seconds from it to the first whole second after it from which `series` (a
    window_mean) is within 1 - fraction of `target` (the run's end when never)."""
    out = []
    for k in kills:
        after = [t for t in range(int(k) + 1, len(series)) if series[t] >= fraction * target]
        out.append(float(after[0] - k if after else len(series) - k))
    return out


def _ratio_curve(faulty: np.ndarray, clean: np.ndarray, starts: np.ndarray, offsets: range,
                 window_s: int) -> np.ndarray:
    """Per offset: sum over the kills of the fault run's count in [k + o, k + o + window) over the
    clean run's (nan where the clean run had none)."""
    out = np.full(len(offsets), np.nan)
    for i, o in enumerate(offsets):
        idx = (starts[:, None] + o + np.arange(window_s)[None, :]).ravel()
        c = clean[idx].sum()
        if c > 0:
            out[i] = faulty[idx].sum() / c
    return out


def _recovered(curve: np.ndarray, fraction: float) -> float | None:
    """The first offset (index) from which every value of the curve is >= fraction; None when its
    last one is not."""
    ok = np.nan_to_num(curve, nan=1.0) >= fraction
    if not ok[-1]:
        return None
    bad = np.flatnonzero(~ok)
    return float(bad[-1] + 1) if len(bad) else 0.0


def epoch_recovery(faulty: np.ndarray, clean: np.ndarray, kills: Sequence[float], horizon_s: int = 10,
                   window_s: int = 2, pre_s: int = 3, fraction: float = 0.9, boots: int = 1000,
                   seed: int = 0) -> dict:
    """The kills superposed (see the module's docstring). `faulty` and `clean` are good_per_s of
    the two runs; kills whose horizon runs past the series or whose pre_s seconds start before 0
    are left out. Returns the ratio at each offset 0 .. horizon_s - window_s (window_s seconds
    from it), its bootstrap 95 % interval, the ratio over the pre_s seconds before the kills,
    `recovered_s` (None: not back within `fraction` before the horizon) and its interval (a
    resample that never recovers counts as horizon_s)."""
    n = min(len(faulty), len(clean))
    starts = np.array([int(k) for k in kills if int(k) - pre_s >= 0 and int(k) + horizon_s <= n], dtype=int)
    if len(starts) == 0:
        return {"kills": 0}
    offsets = range(0, horizon_s - window_s + 1)
    curve = _ratio_curve(faulty, clean, starts, offsets, window_s)
    rng = np.random.default_rng(seed)
    curves, recs = [], []
    for _ in range(boots):
        pick = starts[rng.integers(0, len(starts), len(starts))]
        c = _ratio_curve(faulty, clean, pick, offsets, window_s)
        curves.append(c)
        r = _recovered(c, fraction)
        recs.append(float(horizon_s) if r is None else r)
    lo, hi = np.nanpercentile(np.array(curves), [2.5, 97.5], axis=0)
    before = _ratio_curve(faulty, clean, starts - pre_s, range(0, 1), pre_s)[0]
    return {"kills": len(starts), "window_s": window_s, "horizon_s": horizon_s, "fraction": fraction,
            "ratio": [round(float(x), 3) for x in curve],
            "ratio_ci95": [[round(float(a), 3), round(float(b), 3)] for a, b in zip(lo, hi)],
            "ratio_before": round(float(before), 3),
            "recovered_s": _recovered(curve, fraction),
            "recovered_s_ci95": [float(np.percentile(recs, 2.5)), float(np.percentile(recs, 97.5))]}


def isolated(kills: Sequence[float], others: Sequence[float], before_s: float, after_s: float) -> list[float]:
    """The kills with no other fault (stop, drain) from before_s seconds before them to after_s
    after: what a kill alone costs."""
    return [k for k in kills if not any(k - before_s <= o < k + after_s for o in others)]
