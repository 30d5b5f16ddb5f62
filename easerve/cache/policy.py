"""Bookkeeping of the encoder-output cache: a byte-bounded LRU with single-flight entries.

Pure and torch-free: the caller gives each value's size in bytes and holds whatever it
needs to wake waiters (the encode process wraps this in `easerve.cache.embeddings`). A key
is in one of three states:

- ready: its value is held; `lookup` returns it and makes it the most recently used;
- in flight: someone `begin`-ed computing it; later lookups of the same key are told to
  wait for that computation instead of starting their own (single flight);
- absent.

`complete(key, value, size)` turns an in-flight key ready and evicts least recently used
values until the held bytes fit the capacity again; `fail(key)` forgets an in-flight key.
A value larger than the whole capacity is handed back to its waiters but never held.

`HolderMap` is the gateway's side: which encode instance it last sent each media hash to,
so a request can be placed where its embeddings probably are.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

HIT, PENDING, MISS = "hit", "pending", "miss"


@dataclass(frozen=True)
class Lookup:
    state: str           # HIT | PENDING | MISS
    value: Any = None    # the held value on a HIT


@dataclass
class CacheStats:
    hits: int = 0        # lookups answered with a held value
    joins: int = 0       # lookups told to wait for an in-flight computation
    misses: int = 0      # lookups of an absent key
    evictions: int = 0   # values dropped to fit the byte bound
    oversized: int = 0   # values completed but too large to hold at all


class EncoderCachePolicy:
    """Byte-bounded LRU of ready values plus the set of in-flight keys."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"the encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self._ready: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # LRU first
        self._inflight: set[Hashable] = set()
        self.bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._ready)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ready

    def keys(self) -> list[Hashable]:
        """Held keys, least recently used first."""
        return list(self._ready)

    def holds(self, key: Hashable) -> bool:
        """Whether `key` is held (no effect on LRU order or the counters)."""
        return key in self._ready

    def lookup(self, key: Hashable) -> Lookup:
        if key in self._ready:
            self._ready.move_to_end(key)
            self.stats.hits += 1
            return Lookup(HIT, self._ready[key][0])
        if key in self._inflight:
            self.stats.joins += 1
            return Lookup(PENDING)
        self.stats.misses += 1
        return Lookup(MISS)

    def begin(self, key: Hashable) -> None:
        """Mark `key` in flight: the caller computes it and must `complete` or `fail` it."""
        if key in self._ready or key in self._inflight:
            raise ValueError(f"cache key {key!r} is already held or in flight; lookup() before begin()")
        self._inflight.add(key)

    def complete(self, key: Hashable, value: Any, size: int) -> list[Hashable]:
        """Hold the computed value; returns the keys evicted to make room (LRU first)."""
        if key not in self._inflight:
            raise ValueError(f"cache key {key!r} is not in flight; begin() it first")
        if size < 0:
            raise ValueError(f"a cached value's size must be >= 0 bytes, got {size}")
        self._inflight.discard(key)
        if size > self.capacity:
            self.stats.oversized += 1
            return []
        self._ready[key] = (value, size)
        self.bytes += size
        evicted = []
        while self.bytes > self.capacity:
            old, (_v, old_size) = self._ready.popitem(last=False)
            self.bytes -= old_size
            evicted.append(old)
        self.stats.evictions += len(evicted)
        return evicted

    def fail(self, key: Hashable) -> None:
        """Forget an in-flight key (its computation failed or was abandoned)."""
        if key not in self._inflight:
            raise ValueError(f"cache key {key!r} is not in flight")
        self._inflight.discard(key)

    @property
    def inflight(self) -> int:
        return len(self._inflight)


class HolderMap:
    """Count-bounded LRU of media hash -> the encode instance last sent it (gateway side)."""

    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._where: OrderedDict[Hashable, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def note(self, keys: Iterable[Hashable], addr: str) -> None:
        for k in keys:
            self._where[k] = addr
            self._where.move_to_end(k)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    def holder(self, keys: Iterable[Hashable]) -> str | None:
        """The instance noted for the most of `keys` (ties: the first such key's), or None."""
        counts: dict[str, int] = {}
        for k in keys:
            addr = self._where.get(k)
            if addr is not None:
                counts[addr] = counts.get(addr, 0) + 1
        return max(counts, key=counts.__getitem__) if counts else None

    def forget(self, keys: Iterable[Hashable], addr: str) -> None:
        """Drop the keys noted at `addr` (it answered that it no longer holds them)."""
        for k in keys:
            if self._where.get(k) == addr:
                del self._where[k]
