"""A small Prometheus registry: counters, gauges and histograms with labels,
rendered in the text exposition format (version 0.0.4). No global state: each
process builds its own `Registry` and passes it where it is needed."""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def _fmt_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()):
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str] | None) -> tuple[str, ...]:
        labels = labels or {}
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._v: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._v[key] = self._v.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._v.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in sorted(self._v.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._v[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._v[key] = self._v.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, doc, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sum: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum[key] = self._sum.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self._counts.get(self._key(labels), []))

    def render(self) -> list[str]:
        out = self.header()
        for key, counts in sorted(self._counts.items()):
            acc = 0
            for bound, c in zip(self.buckets + (math.inf,), counts):
                acc += c
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_fmt_labels(self.labels, key, le)} {acc}")
            out.append(f"{self.name}_sum{_fmt_labels(self.labels, key)} {_num(self._sum[key])}")
            out.append(f"{self.name}_count{_fmt_labels(self.labels, key)} {acc}")
        return out


class Registry:
    """Metrics of one process, plus callbacks that refresh gauges at scrape time."""

    def __init__(self, prefix: str = "easerve_"):
        self.prefix = prefix
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Callable[[], None]] = []

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(self.prefix + name, doc, labels))

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(self.prefix + name, doc, labels))

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(self.prefix + name, doc, labels, buckets))

    def on_collect(self, fn: Callable[[], None]) -> None:
        self._collectors.append(fn)

    def get(self, name: str) -> _Metric:
        return self._metrics[self.prefix + name]

    def render(self) -> str:
        for fn in self._collectors:
            fn()
        lines: list[str] = []
        for m in self._metrics.values():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
