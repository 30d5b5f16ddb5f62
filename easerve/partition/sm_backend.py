"""The interface every partition mechanism implements (`SMBackend`), and what the mechanisms
share: the refusal they raise when they cannot run here (`BackendUnavailable`), the check of
their share levels, and the scope that runs a block of CUDA work on one side's stream.

The mechanisms themselves live beside it: the simple ones and the selection among them in
`easerve.partition.backends`, the CPU core split in `cpu_affinity`, CUDA green contexts in
`green_contexts`."""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Literal, Sequence

from easerve.policy.partitioner import Allocation

Worker = Literal["encode", "prefill"]
WORKERS: tuple[str, ...] = ("encode", "prefill")


class BackendUnavailable(RuntimeError):
    """The partition asked for cannot be realized here (the mechanism is missing or refused);
    the message says why, and `select_backend` names the flag to change."""


def check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    """The encode shares a backend offers, as floats; ValueError unless strictly increasing in (0, 1]."""
    lv = tuple(float(x) for x in levels)
    if not lv or list(lv) != sorted(set(lv)) or not all(0 < x <= 1 for x in lv):
        raise ValueError(f"levels must be strictly increasing shares in (0, 1], got {list(levels)}")
    return lv


class SMBackend:
    """Base: bookkeeping of the live level; subclasses override `_switch` and the contexts.
    `encode_context(level, sync)`: level None = the level of the last `apply`; `sync` (CUDA
    only) makes the block's GPU work complete on exit."""

    name: ClassVar[str] = "base"
    dynamic: ClassVar[bool] = False  # can apply() change the split at run time?

    def __init__(self, levels: Sequence[float], reason: str) -> None:
        self.levels = check_levels(levels)
        self.reason = reason
        self.degraded = ""  # why this backend partitions less than asked ("" = it does not)
        self.level = len(self.levels) - 1  # start encode-protective

    def realized(self, level: int | None = None) -> Allocation:
        """The shares `level` (default: the live one) gives encode and prefill. Prefill 0.0
        means it has nothing of its own and time-slices with encode (the partitioner's
        convention at share 1.0)."""
        i = self.level if level is None else level
        share = self.levels[i]
        return Allocation(share, 0.0 if share >= 1.0 else round(1.0 - share, 9), i)

    def level_for(self, encode_share: float) -> int:
        """Index of the smallest level >= encode_share (the largest level if none is)."""
        for i, lv in enumerate(self.levels):
            if lv >= encode_share - 1e-9:
                return i
        return len(self.levels) - 1

    def apply(self, allocation: Allocation) -> int:
        idx = self.level_for(allocation.encode_share)
        if idx != self.level:
            self._switch(idx)
            self.level = idx
        return idx

    def _switch(self, idx: int) -> None:
        pass

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "reason": self.reason, "levels": list(self.levels),
                "level": self.level, "dynamic": self.dynamic, "degraded": self.degraded,
                "realized": [vars(self.realized(i)) for i in range(len(self.levels))]}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(levels={self.levels}, level={self.level}, reason={self.reason!r})"


@contextlib.contextmanager
def stream_scope(stream: Any, sync: bool, torch: Any, enter: Any = None):
    """Run a block on `stream`, after the work already queued on the caller's current stream
    (inputs it uploaded). `torch`: the torch module (or a stand-in). `enter`: for a stream of another CUDA context (a green context), a
    scope that makes that context current; the wait on the caller's stream is set up before
    it, so that event is recorded in the caller's context, and events recorded inside the
    block belong to `stream`'s context (an event may only be recorded on a stream of its own
    context; a stream may wait on an event of any). With `sync`, the exit waits on the host
    for this stream alone, so results are ready for any thread or stream and the other
    side's stream keeps running; without it the caller orders the hand-off with CUDA events.
    (A GPU-side wait of the shared default stream instead would chain encode and prefill
    back together.)"""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with enter() if enter is not None else contextlib.nullcontext(), torch.cuda.stream(stream):
        yield stream
    if sync:
        stream.synchronize()
