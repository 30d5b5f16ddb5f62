"""A client-side open-loop load driver for the fault and overload tests.

Requests go out at a constant rate whether or not earlier ones have finished (open loop:
a stalled stack cannot slow the offered load down), as non-streamed
`/v1/chat/completions` calls, each with its own deadline (the request's `timeout`, which
the gateway enforces) and a client-side limit past it (`slack_s`): a request still open
then counts as hung. Every request sent gets exactly one `Outcome`, so the test can check
sent == completed + errored from its own counts, never from the server's.

    drv = LoadDriver(url, bodies, deadline_s=10)
    async with drv:
        await drv.run(rate=4, duration_s=30)
    drv.tally().by_status  # {200: 110, 503: 9, 'hung': 1}
    drv.goodput(window_s=5)  # [(window start s, completed/s), ...]
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp

HUNG, REFUSED = "hung", "refused"  # no HTTP answer: past deadline + slack / no connection


@dataclass
class Outcome:
    index: int
    sent_s: float
    end_s: float | None = None
    status: int | str | None = None  # HTTP status, HUNG or REFUSED
    retry_after: str | None = None
    detail: str = ""

    @property
    def latency_s(self) -> float:
        return (self.end_s or self.sent_s) - self.sent_s


@dataclass(frozen=True)
class Tally:
    sent: int
    completed: int
    errored: int
    by_status: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"sent {self.sent} = completed {self.completed} + errored {self.errored} "
                f"({', '.join(f'{k}: {v}' for k, v in sorted(self.by_status.items(), key=str))})")


class LoadDriver:
    def __init__(self, url: str, bodies: Sequence[dict], *, deadline_s: float, slack_s: float = 10.0):
        if not bodies:
            raise ValueError("give at least one request body")
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.deadline_s, self.slack_s = deadline_s, slack_s
        self._bodies = [json.dumps({**b, "timeout": deadline_s}).encode() for b in bodies]
        self._next = itertools.count()
        self.outcomes: list[Outcome] = []
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        self.t0 = time.monotonic()

    def clock(self) -> float:
        return time.monotonic() - self.t0

    async def __aenter__(self) -> LoadDriver:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                              timeout=aiohttp.ClientTimeout(total=self.deadline_s + self.slack_s))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.settle()
        await self._session.close()

    async def run(self, rate: float, duration_s: float) -> None:
        """Send at `rate` requests/s for `duration_s` (constant gaps); returns once the last
        is sent (they finish in the background; `settle()` waits for them)."""
        if rate <= 0 or duration_s <= 0:
            raise ValueError(f"rate and duration_s must be > 0, got {rate}, {duration_s}")
        start, n = time.monotonic(), int(rate * duration_s)
        for k in range(n):
            delay = start + k / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.send()

    async def run_closed(self, concurrency: int, duration_s: float) -> float:
        """`concurrency` clients, each sending its next request when the last one ends, for
        `duration_s`; returns the completed requests/s (the stack's capacity for these bodies)."""
        end, t_from = time.monotonic() + duration_s, self.clock()

        async def client() -> None:
            while time.monotonic() < end:
                await self._launch()[1]

        await asyncio.gather(*(client() for _ in range(concurrency)))
        done = [o for o in self.outcomes if o.sent_s >= t_from and o.status == 200]
        return len(done) / (self.clock() - t_from)

    def send(self) -> Outcome:
        """Send the next body now (it finishes in the background)."""
        return self._launch()[0]

    def _launch(self) -> tuple[Outcome, asyncio.Task]:
        i = next(self._next)
        out = Outcome(i, self.clock())
        self.outcomes.append(out)
        task = asyncio.get_running_loop().create_task(self._one(self._bodies[i % len(self._bodies)], out))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return out, task

    async def settle(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def _one(self, body: bytes, out: Outcome) -> None:
        try:
            async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
                text = await r.text()
                out.status, out.retry_after = r.status, r.headers.get("Retry-After")
                if r.status != 200:
                    out.detail = text[:300]
        except asyncio.TimeoutError:
            out.status, out.detail = HUNG, f"no answer within deadline + {self.slack_s:g} s"
        except aiohttp.ClientConnectionError as e:
            out.status, out.detail = REFUSED, f"{type(e).__name__}: {e}"
        finally:
            out.end_s = self.clock()

    # ---- views ---------------------------------------------------------------------------------
    def tally(self) -> Tally:
        by = Counter(o.status for o in self.outcomes)
        done = by.get(200, 0)
        errored = sum(v for k, v in by.items() if k != 200 and k is not None)
        return Tally(len(self.outcomes), done, errored, dict(by))

    def goodput(self, window_s: float = 5.0, since_s: float = 0.0, until_s: float | None = None) -> list[tuple[float, float]]:
        """(window start, completed requests/s) of consecutive windows, by completion time."""
        until = self.clock() if until_s is None else until_s
        ends = [o.end_s for o in self.outcomes if o.status == 200]
        out, t = [], since_s
        while t + window_s <= until + 1e-9:
            out.append((round(t, 3), sum(t <= e < t + window_s for e in ends) / window_s))
            t += window_s
        return out

    def between(self, t_from: float, t_to: float) -> list[Outcome]:
        """Requests sent in [t_from, t_to)."""
        return [o for o in self.outcomes if t_from <= o.sent_s < t_to]


def recovery_s(series: list[tuple[float, float]], kill_index: int, baseline: float,
               fraction: float = 0.9) -> float | None:
    """Seconds from the kill to the end of the first window at or after it (series[kill_index:],
    the first of which starts at the kill) whose goodput is back to `fraction` x baseline
    (None: never, within the series)."""
    window = series[1][0] - series[0][0] if len(series) > 1 else 0.0
    for k, (_, rate) in enumerate(series[kill_index:]):
        if rate >= fraction * baseline:
            return (k + 1) * window
    return None


def image_bodies(model: str, n: int, *, size: int = 64, max_tokens: int = 8, seed: int = 0) -> list[dict]:
    """n chat requests with one distinct PNG each (so every one is encoded, no cache hits)."""
    from hasctl.workload import WorkloadSpec, synthesize

    spec = WorkloadSpec(modality="image", image_size=(size, size), input_tokens=8, output_tokens=max_tokens)
    return [{"model": model, "messages": list(r.messages), "max_tokens": max_tokens, "temperature": 0.0,
             "ignore_eos": True} for r in synthesize(spec, n, seed)]


def text_bodies(model: str, n: int, *, max_tokens: int = 8, seed: int = 0) -> list[dict]:
    from hasctl.workload import text_of

    return [{"model": model, "messages": [{"role": "user", "content": text_of(16, seed * 7919 + i)}],
             "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for i in range(n)]


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url.rstrip("/") + "/v1/models") as r:
            return (await r.json())["data"][0]["id"]


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None
