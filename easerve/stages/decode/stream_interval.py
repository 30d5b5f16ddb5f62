"""How often a decode stream sends its tokens: one message per token costs a gRPC write on
decode and a read on the gateway (a few hundred microseconds of host CPU each), which with a
fast model is most of the stage's work; at most one message per `--stream-interval-ms`
costs no time to the first token and none to the mean time per output token.

`Coalescer` is the rule, pure with an injected clock: `add` a step's output and it answers
the chunk to send now, or None to hold the tokens. The first output is sent at once; after
it, outputs are held until `interval_s` has passed since the last send, and a finished output
takes whatever is held with it. So a token waits at most the interval plus one decode step
(the next step's output sends it), and with steps slower than the interval every output is
sent as it comes, as with an interval of 0. Outputs of another choice (sampling n > 1) send
what is held first: a chunk carries one choice.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_STREAM_INTERVAL_MS = 20.0
MAX_STREAM_INTERVAL_MS = 1000.0  # beyond it a held token would approach the gateway's progress deadline


@dataclass
class Held:
    """Tokens of one choice waiting to be sent together."""
    choice: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finished: bool = False  # it ends its choice


class Coalescer:
    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        if not 0.0 <= interval_s <= MAX_STREAM_INTERVAL_MS / 1000:
            raise ValueError(f"--stream-interval-ms must be in [0, {MAX_STREAM_INTERVAL_MS:g}], "
                             f"got {interval_s * 1000:g}")
        self.interval_s, self.clock = interval_s, clock
        self._held: Held | None = None
        self._sent_at = float("-inf")

    def add(self, choice: int, ids: list[int], text: str, logprobs: list, finished: bool) -> list[Held]:
        """One step's output of `choice`; returns the chunks to send now (in order; empty: hold)."""
        out: list[Held] = []
        if self._held is not None and self._held.choice != choice:
            out.append(self._take())
        held = self._held = self._held or Held(choice)
        held.ids += ids
        held.text += text
        held.logprobs += logprobs
        held.finished = finished
        now = self.clock()
        if finished or now - self._sent_at >= self.interval_s:
            out.append(self._take())
            self._sent_at = now
        return out

    def _take(self) -> Held:
        held, self._held = self._held, None
        return held
