"""A sender-owned shared-memory slab, reused across payloads (no page faults once warm).

Each region starts with a 64-byte header {state u8, generation u64}, the payload follows.
The sender allocates (first fit) and marks a region WRITTEN; the receiver checks the
generation of its handle, marks it TAKEN, and rebuilds tensors as views of it; when the last
view dies a finalizer marks it FREE, and the sender's next allocation reclaims it.
One writer per slab (the sending process) and one byte flipped per transition, so no locks.
The sender's process registers the slab with Python's resource tracker, which unlinks it
even if the process dies; close() unlinks it at once.
"""
from __future__ import annotations

import bisect
import itertools
import mmap
import os
import struct
import time
import weakref
from collections import OrderedDict
from multiprocessing import resource_tracker

import _posixshmem
import numpy as np

from easerve.rpc.errors import NotFound

REGION_HDR = 64
_HDR = struct.Struct("<B7xQ")  # state, generation
FREE, WRITTEN, TAKEN = 0, 1, 2
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


class SlabWriter:
    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, _align(size)
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, flags=_FLAGS)
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")
        self._free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, length)
        self._used: dict[int, tuple[int, int, float]] = {}  # region -> (length, generation, expiry)
        self._gens = itertools.count(1)

    @property
    def used_bytes(self) -> int:
        return sum(length for length, _, _ in self._used.values())

    def alloc(self, nbytes: int, ttl_s: float) -> tuple[int, int] | None:
        """(payload offset, generation) of a fresh WRITTEN region, or None when it does not fit."""
        self.reclaim()
        need = _align(REGION_HDR + nbytes)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                self._free[i: i + 1] = [(off + need, length - need)] if length > need else []
                gen = next(self._gens)
                _HDR.pack_into(self._mm, off, WRITTEN, gen)
                self._used[off] = (need, gen, time.monotonic() + ttl_s)
                return off + REGION_HDR, gen
        return None

    def buffer(self, payload_off: int, nbytes: int) -> memoryview:
        return memoryview(self._mm)[payload_off: payload_off + nbytes]

    def free(self, payload_off: int, generation: int) -> None:
        """Give back a region no receiver took (a region being read is left alone)."""
        off = payload_off - REGION_HDR
        entry = self._used.get(off)
        if entry and entry[1] == generation and self._mm[off] == WRITTEN:
            self._mm[off] = FREE
        self.reclaim()

    def reclaim(self) -> None:
        """Regions receivers freed, and WRITTEN ones nobody took before their expiry."""
        now = time.monotonic()
        for off, (length, _, expiry) in list(self._used.items()):
            if self._mm[off] == WRITTEN and expiry <= now:
                self._mm[off] = FREE
            if self._mm[off] == FREE:
                del self._used[off]
                self._insert_free(off, length)

    def _insert_free(self, off: int, length: int) -> None:
        i = bisect.bisect(self._free, (off, length))
        self._free.insert(i, (off, length))
        if i + 1 < len(self._free) and off + length == self._free[i + 1][0]:
            self._free[i: i + 2] = [(off, length + self._free[i + 1][1])]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1: i + 1] = [(self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])]

    def close(self) -> None:
        try:
            _posixshmem.shm_unlink("/" + self.name)
            resource_tracker.unregister("/" + self.name, "shared_memory")
        except FileNotFoundError:
            pass
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is alive; the mapping goes with it


class SlabReader:
    """Receiver side: maps each sender's slab once (the `max_slabs` most recent ones)."""

    def __init__(self, max_slabs: int = 16) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self.max_slabs = max_slabs

    def take(self, name: str, offset: int, size: int, generation: int) -> np.ndarray:
        """The region's payload bytes, marked TAKEN; FREE again once the array (and every
        view built on it) is gone."""
        mm = self._map(name)
        off = offset - REGION_HDR
        if off < 0 or offset + size > len(mm):
            raise NotFound(f"region [{offset}, +{size}) lies outside slab {name!r} of {len(mm)} bytes")
        state, gen = _HDR.unpack_from(mm, off)
        if gen != generation or state != WRITTEN:
            raise NotFound(f"slab {name!r} region at {offset} was already taken, released or reused "
                           f"(state {state}, generation {gen}, handle has {generation})")
        mm[off] = TAKEN
        arr = np.frombuffer(mm, dtype=np.uint8, count=size, offset=offset)
        weakref.finalize(arr, _mark_free, mm, off)
        return arr

    def _map(self, name: str) -> mmap.mmap:
        if name in self._maps:
            self._maps.move_to_end(name)
            return self._maps[name]
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise NotFound(f"slab {name!r} is gone (its sender closed or exited)") from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=_FLAGS)
        finally:
            os.close(fd)
        _drop_unlinked(self._maps)
        self._maps[name] = mm
        while len(self._maps) > self.max_slabs:  # views of an evicted slab keep it mapped
            self._maps.popitem(last=False)
        return mm

    def close(self) -> None:
        self._maps.clear()


def _drop_unlinked(maps: OrderedDict) -> None:
    """Forget the mappings of slabs whose name is gone (their sender closed or died and the
    slab was reclaimed), so their memory is freed once no view of them is left."""
    for name in [n for n in maps if not os.path.exists(f"/dev/shm/{n}")]:
        del maps[name]


def _mark_free(mm: mmap.mmap, off: int) -> None:
    try:
        mm[off] = FREE
    except ValueError:  # mapping already closed
        pass
