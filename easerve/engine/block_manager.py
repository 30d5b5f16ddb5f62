"""Torch-free KV bookkeeping: which blocks of the pool each request owns.

Capacity is `num_blocks` blocks of `block_size` token positions. Two layouts use it:
- paged (GPU): small blocks (e.g. 16 tokens), a request owns ceil(reserve / block_size) of them;
- slots (CPU): one block per request, block_size = max_seq_len (a "slot").

A request reserves prompt_len + max_tokens positions when it is admitted, so an admitted
request can never run out of KV mid-decode; `append` then hands out the next position.
A request with n choices (`allocate_group`) is n sequences admitted together: the first owns
its blocks; every other shares the blocks the prompt fills entirely (reference counts) and
owns the rest, the partial last prompt block included (the engine copies only that block's
prompt positions into it). A block goes back to the free list when its last holder frees it.
The slot layout (one block per sequence, prompt_len < block_size) shares nothing: each
choice holds a slot of its own with its own copy of the prompt.
Free blocks are handed out lowest id first. In the slot layout `compact()` keeps the owned
slots exactly 0..n-1 (the engine then reads the batch's KV as one strided view), moving the
highest slots into holes and reporting each move for the engine to copy.
The manager never touches physical memory (see `kv_pool`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class _Seq:
    blocks: list[int]
    num_tokens: int   # positions already holding KV
    reserved: int     # positions this request may ever use
    borrowed: int = 0  # leading blocks shared with the first sequence of its group


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seq_tokens: int | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # the most positions one request may reserve (slots: block_size; paged: the whole pool)
        self.max_seq_tokens = min(max_seq_tokens or self.capacity_tokens, self.capacity_tokens)
        self._free: list[int] = list(range(num_blocks))  # a min-heap: lowest free id first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._seqs: dict[str, _Seq] = {}

    # ---- capacity ---------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_tokens(self) -> int:
        """Token positions in blocks no request owns."""
        return len(self._free) * self.block_size

    @property
    def reserved_tokens(self) -> int:
        """Token positions in blocks owned by requests (capacity - free)."""
        return self.capacity_tokens - self.free_tokens

    @property
    def used_tokens(self) -> int:
        """Token positions that actually hold KV now (a shared block counted once)."""
        return sum(s.num_tokens - s.borrowed * self.block_size for s in self._seqs.values())

    def group_blocks(self, reserve_tokens: int, prompt_len: int = 0, n: int = 1) -> int:
        """Blocks n sequences of `reserve_tokens` take when they share the prompt's full blocks."""
        own = self.blocks_needed(reserve_tokens)
        return own + (n - 1) * (own - min(prompt_len // self.block_size, own))

    def fits_ever(self, reserve_tokens: int, prompt_len: int = 0, n: int = 1) -> bool:
        """Whether a reservation this size (n sequences of it) could be admitted into an empty pool."""
        return reserve_tokens <= self.max_seq_tokens and self.group_blocks(reserve_tokens, prompt_len, n) <= self.num_blocks

    # ---- admission / release --------------------------------------------------------------
    def can_allocate(self, reserve_tokens: int, prompt_len: int = 0, n: int = 1) -> bool:
        return self.group_blocks(reserve_tokens, prompt_len, n) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int, reserve_tokens: int) -> list[int]:
        """Reserve blocks for `reserve_tokens` positions, the first `num_tokens` already
        filled (the prompt KV the caller writes next). Returns the block table."""
        if seq_id in self._seqs:
            raise ValueError(f"request {seq_id!r} already holds KV blocks")
        if not 0 < num_tokens <= reserve_tokens:
            raise ValueError(f"need 0 < num_tokens <= reserve_tokens, got {num_tokens}, {reserve_tokens}")
        if not self.fits_ever(reserve_tokens) or not self.can_allocate(reserve_tokens):
            raise RuntimeError(f"no room for {reserve_tokens} tokens; call can_allocate first")
        blocks = self._take(self.blocks_needed(reserve_tokens))
        self._seqs[seq_id] = _Seq(blocks, num_tokens, reserve_tokens)
        return list(blocks)

    def allocate_group(self, seq_ids: list[str], num_tokens: int, reserve_tokens: int) -> list[list[int]]:
        """`allocate` for the n choices of one request: the first sequence gets blocks of its
        own, the others share its blocks that the `num_tokens` prompt positions fill entirely
        (`borrowed_tokens`) and own the rest. Returns each sequence's block table."""
        if len(set(seq_ids)) != len(seq_ids) or any(s in self._seqs for s in seq_ids):
            raise ValueError(f"sequence ids {seq_ids!r} must be new and distinct")
        if not self.fits_ever(reserve_tokens, num_tokens, len(seq_ids)) or \
                not self.can_allocate(reserve_tokens, num_tokens, len(seq_ids)):
            raise RuntimeError(f"no room for {len(seq_ids)} x {reserve_tokens} tokens; call can_allocate first")
        lead = self.allocate(seq_ids[0], num_tokens, reserve_tokens)
        shared = min(num_tokens // self.block_size, len(lead))
        for sid in seq_ids[1:]:
            for b in lead[:shared]:
                self._refs[b] += 1
            blocks = lead[:shared] + self._take(len(lead) - shared)
            self._seqs[sid] = _Seq(blocks, num_tokens, reserve_tokens, shared)
        return [list(self._seqs[sid].blocks) for sid in seq_ids]

    def _take(self, count: int) -> list[int]:
        blocks = [heapq.heappop(self._free) for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, seq_id: str) -> bool:
        """Give the request's blocks back (a shared block once its last holder frees it).
        Returns False if it held none."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        for b in seq.blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)
        return True

    def compact(self) -> list[tuple[str, int, int]]:
        """Slot layout only (one block per request): move requests out of the highest slots
        into the holes below n = number of requests, so they own exactly slots 0..n-1.
        Returns the moves (request id, from slot, to slot), highest slot first."""
        if self.max_seq_tokens > self.block_size:
            raise ValueError("compact() needs the slot layout (max_seq_tokens <= block_size: one block a request)")
        n = len(self._seqs)
        if not self._free or self._free[0] >= n:
            return []  # no free slot below n: slots 0..n-1 are all owned
        holes = sorted(b for b in self._free if b < n)
        movers = sorted(((s.blocks[0], rid) for rid, s in self._seqs.items() if s.blocks[0] >= n), reverse=True)
        moves = []
        for hole, (slot, rid) in zip(holes, movers):
            self._seqs[rid].blocks[0] = hole
            self._refs[hole], self._refs[slot] = 1, 0
            moves.append((rid, slot, hole))
        if moves:
            self._free = list(range(n, self.num_blocks))  # already a valid min-heap
        return moves

    # ---- per-step growth -------------------------------------------------------------------
    def can_append(self, seq_id: str) -> bool:
        seq = self._seqs[seq_id]
        return seq.num_tokens < seq.reserved

    def append(self, seq_id: str) -> int:
        """Claim the next position of the request; returns its index (0-based)."""
        seq = self._seqs[seq_id]
        if seq.num_tokens >= seq.reserved:
            raise RuntimeError(f"request {seq_id!r} used its whole reservation of {seq.reserved} tokens")
        seq.num_tokens += 1
        return seq.num_tokens - 1

    def retract(self, seq_id: str) -> None:
        """Undo the last `append` (a step that failed before its KV was written)."""
        seq = self._seqs[seq_id]
        if seq.num_tokens <= 1:
            raise RuntimeError(f"request {seq_id!r} has no appended position to retract")
        seq.num_tokens -= 1

    # ---- lookups -------------------------------------------------------------------------
    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].blocks)

    def num_tokens(self, seq_id: str) -> int:
        return self._seqs[seq_id].num_tokens

    def borrowed_tokens(self, seq_id: str) -> int:
        """Leading positions whose KV the sequence reads from blocks its group's first sequence wrote."""
        return self._seqs[seq_id].borrowed * self.block_size

    def refcount(self, block: int) -> int:
        return self._refs[block]
