"""Host CPU time per request outside model compute, by phase: the one home of that accounting.

A stage builds one `HostTime` on its Prometheus registry; its code wraps each synchronous
stretch of host work in `host.phase(PHASE, acc)`, which measures the calling thread's CPU time
(`time.thread_time`, not wall time: time waiting or spent by other threads is not charged) and
adds it to `easerve:host_cpu_seconds_total{stage,phase}` and, when given, to `acc` (a request's
`HostAccount`: its per-phase seconds, shown in the gateway's GET /trace). Work done in another
process (the gateway's media decode pool) is measured there and added with `host.add`.

A phase must not span an `await`: other coroutines run on the same thread meanwhile, and
their CPU time would be charged to it. Wrap the synchronous calls on either side instead.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

# request parsing; media fetch / decode / resize; chat templates and tokenization; protobuf and
# JSON serialization; tensor movement between stages; scheduling (admission, placement,
# batching); detokenization and streaming the tokens out
PHASES = ("parse", "media", "tokenize", "serialize", "transfer", "schedule", "detokenize")
T = TypeVar("T")


class HostAccount:
    """One request's host CPU seconds by phase (a plain dict underneath, safe to add to from
    several threads: each `+=` on a dict item happens under the GIL as one store)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def total(self) -> float:
        return sum(self.seconds.values())

    def as_ms(self) -> dict[str, float]:
        """{phase: milliseconds} in PHASES order (for /trace)."""
        return {p: round(self.seconds[p] * 1e3, 3) for p in PHASES if p in self.seconds}


class HostTime:
    """`easerve:host_cpu_seconds_total{stage,phase}` of one stage process."""

    def __init__(self, registry: CollectorRegistry, stage: str):
        self.stage = stage
        self.counter = Counter("easerve:host_cpu_seconds", "Host CPU seconds (thread CPU time) spent outside "
                               "model compute, by stage and phase", ["stage", "phase"], registry=registry)
        self._children = {p: self.counter.labels(stage=stage, phase=p) for p in PHASES}

    def add(self, phase: str, seconds: float, acc: HostAccount | None = None) -> None:
        """Charge `seconds` of CPU to `phase` (and to the request's `acc`)."""
        child = self._children.get(phase)
        if child is None:
            raise ValueError(f"unknown host phase {phase!r}; one of {', '.join(PHASES)}")
        if seconds > 0:
            child.inc(seconds)
            if acc is not None:
                acc.add(phase, seconds)

    @contextmanager
    def phase(self, phase: str, acc: HostAccount | None = None) -> Iterator[None]:
        """Charge the calling thread's CPU time inside the block to `phase` (no `await` inside)."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.add(phase, time.thread_time() - t0, acc)

    def timed(self, phase: str, fn: Callable[..., T], acc: HostAccount | None = None) -> Callable[..., T]:
        """`fn` charging its thread CPU time to `phase` where it runs (for an executor thread)."""
        return cpu_timed(fn, lambda s: self.add(phase, s, acc))


def cpu_timed(fn: Callable[..., T], on_cpu: Callable[[float], None]) -> Callable[..., T]:
    """`fn` telling `on_cpu` the CPU seconds of the thread it runs on (for an executor thread)."""
    def run(*args, **kwargs) -> T:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            on_cpu(time.thread_time() - t0)
    return run
