"""Prefix cache bookkeeping: which KV blocks of computed prompts are kept (torch-free).

A prompt is cut into blocks of `block_tokens` tokens; block i is named by a hash chained
from the start (`block_hashes`): sha256 of block i-1's hash and block i's tokens, where a
media placeholder token counts as its item's content hash (`easerve.media.content_hash`),
so the same image in a later turn names the same blocks and a different image at the same
positions does not. Only full blocks are named, and the chain
stops before the first block holding a media item without a content hash (not cacheable).

`PrefixCache` holds the names of the blocks whose KV is kept, within a byte budget:

    cache = PrefixCache(PrefixCacheConfig(block_tokens=16, budget_bytes=2**30), block_bytes=...)
    n = cache.match(hashes, limit)       # leading blocks held (the longest cached prefix)
    cache.acquire(hashes[:n])            # referenced: never evicted until released
    plan = cache.insert(hashes)          # StorePlan: blocks to store now, blocks to drop
    cache.release(hashes[:n])

The caller (`easerve.cache.prefix_kv`) holds the tensors and executes each `StorePlan`.
Eviction takes the least recently used unreferenced block; a chain is touched from its tail
to its head, so a prompt's last blocks leave before its first ones.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from easerve.fields import NonNegInt, PosInt, check_fields


@dataclass(frozen=True)
class PrefixCacheConfig:
    """`block_tokens`: tokens per cached block; `budget_bytes`: KV bytes the blocks may hold."""

    block_tokens: PosInt = 16
    budget_bytes: NonNegInt = 1 << 30

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class StorePlan:
    """Store the KV of `store` (indices into the inserted hashes) and drop `evict` (hashes)."""

    store: tuple[int, ...]
    evict: tuple[bytes, ...]


def block_hashes(token_ids: Sequence[int], media: Mapping[int, bytes], block_tokens: int,
                 salt: bytes = b"") -> list[bytes]:
    """The chained names of the prompt's full blocks. `media`: position -> content hash of
    the media item whose placeholder sits there (b"": not cacheable, the chain stops)."""
    out, parent = [], hashlib.sha256(b"easerve-prefix" + salt).digest()
    for b in range(len(token_ids) // block_tokens):
        h = hashlib.sha256(parent)
        for p in range(b * block_tokens, (b + 1) * block_tokens):
            item = media.get(p)
            if item is None:
                h.update(b"t%d;" % token_ids[p])
            elif not item:
                return out
            else:
                h.update(b"m" + item)
        parent = h.digest()
        out.append(parent)
    return out


def media_positions(input_ids: list[int], items: list[tuple[str, int, bytes]],
                    placeholder_ids: dict[str, int]) -> dict[int, bytes]:
    """Prompt position -> content hash of the media item whose placeholder sits there.
    `items`: (modality, placeholder rows, content hash) per item in prompt order; the k-th
    item of a modality takes the next rows-many placeholders of that modality."""
    out: dict[int, bytes] = {}
    for mod, tid in placeholder_ids.items():
        spots = [p for p, t in enumerate(input_ids) if t == tid]
        at = 0
        for kind, rows, h in items:
            if kind == mod:
                out.update((p, h) for p in spots[at:at + rows])
                at += rows
        out.update((p, b"") for p in spots[at:])  # placeholders no item claims: never cached
    return out


class PrefixCache:
    """Names of kept blocks, their reference counts and LRU order. Not thread-safe."""

    def __init__(self, config: PrefixCacheConfig, block_bytes: int):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.config, self.block_bytes = config, block_bytes
        self._refs: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()  # unreferenced, least recent first

    @property
    def capacity_blocks(self) -> int:
        return self.config.budget_bytes // self.block_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def used_bytes(self) -> int:
        return len(self._refs) * self.block_bytes

    def holds(self, h: bytes) -> bool:
        return h in self._refs

    def refs(self, h: bytes) -> int:
        return self._refs.get(h, 0)

    def match(self, hashes: Sequence[bytes], limit: int | None = None) -> int:
        """How many leading blocks of `hashes` (at most `limit`) are held."""
        n = 0
        for h in hashes[: len(hashes) if limit is None else max(limit, 0)]:
            if h not in self._refs:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[bytes]) -> None:
        """Reference held blocks (a request reads them): they are not evicted until released."""
        missing = [h for h in hashes if h not in self._refs]
        if missing:
            raise KeyError(f"acquire of {len(missing)} block(s) not held; match() first")
        for h in hashes:
            self._refs[h] += 1
            self._free.pop(h, None)

    def release(self, hashes: Sequence[bytes]) -> None:
        """Drop one reference of each; the chain becomes evictable, its tail first."""
        for h in hashes:
            if self._refs.get(h, 0) < 1:
                raise KeyError("release of a block that is not referenced; release what was acquired, once")
            self._refs[h] -= 1
        self._touch(hashes)

    def insert(self, hashes: Sequence[bytes]) -> StorePlan:
        """Keep a computed prompt's blocks (its chain from the start): the ones not held yet
        are stored while room can be made by evicting unreferenced blocks; the first that
        cannot ends the insert (a block is useless without its parents)."""
        store, evict, chain = [], [], set(hashes)  # the chain's own blocks are not evicted for it
        for i, h in enumerate(hashes):
            if h in self._refs:
                continue
            if len(self._refs) >= self.capacity_blocks:
                old = next((o for o in self._free if o not in chain), None)
                if old is None:
                    break
                del self._free[old], self._refs[old]
                evict.append(old)
            self._refs[h] = 0
            self._free[h] = None
            store.append(i)
        self._touch([h for h in hashes if h in self._refs])
        return StorePlan(tuple(store), tuple(evict))

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):  # the head ends most recent: evicted last
            if self._refs.get(h) == 0:
                self._free[h] = None
                self._free.move_to_end(h)
