"""Serving metrics from per-request records: the pure half of `hasctl bench`.

Definitions (DESIGN §6; names as `vllm bench serve` writes them where the two overlap):
- TTFT = first content chunk received - request sent.
- TPOT = (last content chunk - first content chunk) / (output tokens - 1), for requests with
  more than one output token. (vLLM divides (end of stream - first token) instead: the same
  number up to the final usage/[DONE] chunk.) Output tokens = the server's
  usage.completion_tokens when it sent one, else the number of content chunks.
- ITL = each gap between consecutive content chunks of a request (pooled over requests).
- E2E (`e2el`) = end of the stream - request sent.
- duration = the run's start (first scheduled send) to the end of the last request.
- request_throughput = successful requests / duration; output_throughput = their output
  tokens / duration; total_token_throughput adds the prompt tokens the server reported.
- goodput (`request_goodput`) = successful requests with TTFT <= its TTFT limit and TPOT <=
  its TPOT limit, per second of duration. A one-token request meets any TPOT limit (as in
  vLLM). slo_attainment = those requests / all requests sent (failures count as misses).
Percentile p is numpy's linear interpolation (vLLM's `np.percentile`); `median_*` is p50.
All times in records are seconds on one monotonic clock; reported latencies are in ms.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request (seconds on the run's clock, 0 = run start)."""

    index: int
    modality: str
    scheduled_s: float
    sent_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    end_s: float | None = None
    output_tokens: int | None = None   # usage.completion_tokens, if the server sent usage
    prompt_tokens: int | None = None
    error: str | None = None
    error_kind: str | None = None      # http_400, http_429, http_503, timeout, connection, stream, ...

    @property
    def ok(self) -> bool:
        return self.error is None and self.sent_s is not None and self.end_s is not None and bool(self.chunk_s)

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        n = self.tokens
        return (self.chunk_s[-1] - self.chunk_s[0]) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.sent_s

    def to_dict(self) -> dict:
        return {"index": self.index, "modality": self.modality, "scheduled_s": self.scheduled_s,
                "sent_s": self.sent_s, "chunk_s": self.chunk_s, "end_s": self.end_s,
                "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
                "error": self.error, "error_kind": self.error_kind}

    @classmethod
    def from_dict(cls, d: Mapping) -> RequestRecord:
        return cls(**{k: d.get(k) for k in ("index", "modality", "scheduled_s", "sent_s", "end_s",
                                               "output_tokens", "prompt_tokens", "error", "error_kind")},
                   chunk_s=list(d.get("chunk_s") or []))


@dataclass(frozen=True)
class SLO:
    """TTFT and TPOT limits (ms); `by_modality` overrides them for requests of a modality."""

    ttft_ms: float
    tpot_ms: float
    by_modality: tuple[tuple[str, float, float], ...] = ()
    tier: str = ""

    def __post_init__(self) -> None:
        for m, t, p in (("*", self.ttft_ms, self.tpot_ms), *self.by_modality):
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (t, p)):
                raise ValueError(f"SLO limits must be ms > 0, got ttft {t!r}, tpot {p!r} for {m!r}")

    def limits(self, modality: str) -> tuple[float, float]:
        for m, t, p in self.by_modality:
            if m == modality:
                return t, p
        return self.ttft_ms, self.tpot_ms

    def met(self, r: RequestRecord) -> bool:
        ttft, tpot = self.limits(r.modality)
        return r.ok and r.ttft_s * 1e3 <= ttft and (r.tpot_s is None or r.tpot_s * 1e3 <= tpot)

    def to_dict(self) -> dict:
        return {"tier": self.tier, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "by_modality": {m: {"ttft_ms": t, "tpot_ms": p} for m, t, p in self.by_modality}}


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[int]) -> dict[str, float | None]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        out: dict[str, float | None] = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
        return out | {f"p{p}_{name}_ms": None for p in percentiles}
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    return out | {f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}


def duration_of(records: Sequence[RequestRecord]) -> float:
    """Run start (the earliest scheduled send) to the last end (or last send when none ended)."""
    if not records:
        raise ValueError("no requests: nothing to measure")
    start = min(r.scheduled_s for r in records)
    ends = [r.end_s for r in records if r.end_s is not None] or [r.sent_s or start for r in records]
    return max(max(ends) - start, 1e-9)


def compute_metrics(records: Sequence[RequestRecord], slo: SLO | None = None,
                    percentiles: Sequence[int] = PERCENTILES, duration_s: float | None = None) -> dict:
    """The result fields of one run (see the module docstring). Pure."""
    dur = duration_of(records) if duration_s is None else duration_s
    ok = [r for r in records if r.ok]
    series = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
              "itl": [g for r in ok for g in r.itl_s], "e2el": [r.e2el_s for r in ok]}
    out_tokens = sum(r.tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    m: dict = {"duration": dur, "completed": len(ok), "failed": len(records) - len(ok),
               "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
               "total_token_throughput": (in_tokens + out_tokens) / dur}
    if slo is not None:
        good = sum(slo.met(r) for r in records)
        m |= {"request_goodput": good / dur, "slo_met": good, "slo_attainment": good / len(records)}
    else:
        m |= {"request_goodput": None, "slo_met": None, "slo_attainment": None}
    for name in LATENCIES:
        m |= _stats(name, series[name], percentiles)
    m["errors_by_kind"] = dict(Counter(r.error_kind or "unknown" for r in records if not r.ok))
    m["by_modality"] = _by_modality(records, slo, dur)
    return m


def _by_modality(records: Sequence[RequestRecord], slo: SLO | None, dur: float) -> dict:
    out = {}
    for mod in sorted({r.modality for r in records}):
        rs = [r for r in records if r.modality == mod]
        ok = [r for r in rs if r.ok]
        tp = [r.tpot_s for r in ok if r.tpot_s is not None]
        d = {"requests": len(rs), "completed": len(ok), **_stats("ttft", [r.ttft_s for r in ok], (50, 99)),
             **_stats("tpot", tp, (50, 99))}
        if slo is not None:
            good = sum(slo.met(r) for r in rs)
            d |= {"request_goodput": good / dur, "slo_attainment": good / len(rs)}
        out[mod] = {k: v for k, v in d.items() if not k.startswith(("std_", "mean_"))}
    return out
