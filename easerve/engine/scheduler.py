"""Torch-free decode scheduling policy: bounded waiting queue, running set, admission.

`schedule()` produces a typed plan (`SchedulerOutput`) that the engine executes;
`update_from_output()` tells the policy which sequences finished. Admission is strict FCFS:
the head of the waiting queue is admitted when `max_running` and the KV memory allow it,
and nobody behind it jumps ahead (no head-of-line skipping), so a long request is never
starved by a stream of short ones. A request with n choices waits as one entry and is
admitted as n sequences at once (`BlockManager.allocate_group`: they share the prompt's full
blocks), when n rows and the group's blocks fit; plans, finishing and `abort` then name
sequence ids (the request id itself when n = 1).

With `compact=True` (the slot layout) the plan's rows are in slot order and the running
requests own slots 0..n-1: row i reads slot i. Slots freed since the last plan are first
refilled by admission, and any hole left is closed by moving the highest slots down
(`SchedulerOutput.moves`: one KV copy per finished request, never one per step).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from easerve.engine.block_manager import BlockManager
from easerve.errors import InvalidRequest, Overloaded, RequestTooLarge


@dataclass(frozen=True)
class SchedulerOutput:
    """One decode step's plan. Row i of the batch is request_ids[i]: it writes the KV of
    its last token at position positions[i] (so it attends to positions[i] + 1 tokens),
    through block_tables[i]. `admitted` lists the requests whose prompt KV the engine must
    write into the pool before the step (they are in request_ids too). `moves` (slot layout)
    lists (request id, from slot, to slot): the engine copies that request's KV before the
    step (block_tables already name the new slot)."""

    admitted: tuple[str, ...]
    request_ids: tuple[str, ...]
    positions: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    moves: tuple[tuple[str, int, int], ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class _Waiting:
    request_id: str
    prompt_len: int
    reserve_tokens: int
    seq_ids: tuple[str, ...]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_waiting: int, compact: bool = False) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.blocks = blocks
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.compact = compact
        self._waiting: deque[_Waiting] = deque()
        self._running: dict[str, None] = {}  # insertion-ordered set
        self._held: dict[str, float] = {}    # reservations: request id -> expiry time

    # ---- intake -------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_len: int, max_tokens: int, now: float, ttl_s: float,
                n: int = 1) -> None:
        """Hold a place for a request (of n choices) whose prefill has not run yet, so a full
        engine is known before any compute is spent. The place lapses at `now + ttl_s` unless
        `add` takes it. Raises like `add`."""
        self._expire(now)
        if request_id in self._held or request_id in self:
            raise InvalidRequest(f"request id {request_id!r} is already in the engine; ids must be unique")
        reserve = self._check_size(request_id, prompt_len, max_tokens, n)
        if self._full(reserve, prompt_len, n):
            raise Overloaded(f"decode queue is full ({self.max_waiting} waiting); retry later")
        self._held[request_id] = now + ttl_s

    def add(self, request_id: str, prompt_len: int, max_tokens: int, seq_ids: tuple[str, ...] = ()) -> None:
        """Queue a request whose prompt KV (prompt_len tokens) waits outside the pool, as the
        sequences `seq_ids` (its choices; default: the request id alone). A reserved request
        always gets in; others raise Overloaded if the queue is full (RequestTooLarge if it
        could never fit)."""
        seq_ids = tuple(seq_ids) or (request_id,)
        if request_id in self or any(s in self for s in seq_ids):
            raise InvalidRequest(f"request id {request_id!r} is already in the engine; ids must be unique")
        reserve = self._check_size(request_id, prompt_len, max_tokens, len(seq_ids))
        held = self._held.pop(request_id, None) is not None
        if not held and self._full(reserve, prompt_len, len(seq_ids)):
            raise Overloaded(f"decode queue is full ({self.max_waiting} waiting); retry later")
        self._waiting.append(_Waiting(request_id, prompt_len, reserve, seq_ids))

    def release_reservation(self, request_id: str) -> bool:
        """Give back a held place that `add` will never take (the request finished on its
        first token). False if none is held."""
        return self._held.pop(request_id, None) is not None

    def _check_size(self, request_id: str, prompt_len: int, max_tokens: int, n: int = 1) -> int:
        reserve = prompt_len + max_tokens
        if not self.blocks.fits_ever(reserve):
            raise RequestTooLarge(
                f"request {request_id!r} needs {reserve} KV tokens (prompt {prompt_len} + max_tokens "
                f"{max_tokens}) but the engine holds at most {self.blocks.max_seq_tokens} per request; "
                "lower max_tokens or raise the engine's KV capacity / max_seq_len")
        if n > self.max_running or not self.blocks.fits_ever(reserve, prompt_len, n):
            raise RequestTooLarge(
                f"request {request_id!r} asks for n = {n} choices of {reserve} KV tokens: "
                f"{self.blocks.group_blocks(reserve, prompt_len, n) * self.blocks.block_size} tokens and {n} "
                f"running rows, but the engine holds {self.blocks.capacity_tokens} tokens and runs "
                f"{self.max_running} rows; lower n or max_tokens")
        return reserve

    def _full(self, reserve: int, prompt_len: int = 0, n: int = 1) -> bool:
        """No room to wait (reservations count as waiting) and not admissible at once."""
        return (len(self._waiting) + len(self._held) >= self.max_waiting
                and not self._admissible_now(reserve, prompt_len, n))

    def _expire(self, now: float) -> None:
        for rid in [r for r, until in self._held.items() if until <= now]:
            del self._held[rid]

    def _admissible_now(self, reserve: int, prompt_len: int, n: int) -> bool:
        """The next schedule() would admit it at once: it never really waits."""
        return (not self._waiting and not self._held and len(self._running) + n <= self.max_running
                and self.blocks.can_allocate(reserve, prompt_len, n))

    # ---- the plan -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        admitted = self._admit()
        moves = tuple(self.blocks.compact()) if self.compact else ()
        tables = {rid: self.blocks.block_table(rid) for rid in self._running}
        ids = tuple(sorted(tables, key=tables.__getitem__)) if self.compact else tuple(self._running)
        positions = tuple(self.blocks.append(rid) for rid in ids)
        return SchedulerOutput(admitted, ids, positions, tuple(tables[rid] for rid in ids), moves)

    def retract(self, plan: SchedulerOutput) -> None:
        """Undo the positions a plan handed out (its step failed before producing tokens);
        requests it admitted stay running and the next plan gives them the same positions."""
        for rid in plan.request_ids:
            if rid in self._running:
                self.blocks.retract(rid)

    def _admit(self) -> tuple[str, ...]:
        admitted = []
        while self._waiting and len(self._running) + len(self._waiting[0].seq_ids) <= self.max_running:
            head = self._waiting[0]
            if not self.blocks.can_allocate(head.reserve_tokens, head.prompt_len, len(head.seq_ids)):
                break  # FCFS: wait for room rather than let later requests jump ahead
            self._waiting.popleft()
            self.blocks.allocate_group(list(head.seq_ids), head.prompt_len, head.reserve_tokens)
            for sid in head.seq_ids:
                self._running[sid] = None
            admitted.extend(head.seq_ids)
        return tuple(admitted)

    def update_from_output(self, finished: Iterable[str]) -> None:
        """Release the KV of requests that finished in the step just executed."""
        for rid in finished:
            self._release(rid)

    def _release(self, request_id: str) -> bool:
        if request_id not in self._running:
            return False
        del self._running[request_id]
        self.blocks.free(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a reserved or waiting request, or a running sequence, at once (its KV is
        freed). False if unknown."""
        if self._held.pop(request_id, None) is not None:
            return True
        if self._release(request_id):
            return True
        for item in self._waiting:
            if item.request_id == request_id:
                self._waiting.remove(item)
                return True
        return False

    # ---- state -----------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running or any(w.request_id == request_id for w in self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)
