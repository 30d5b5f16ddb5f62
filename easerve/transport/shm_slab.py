"""A sender-owned shared-memory slab, reused across payloads (no page faults once warm).

Each region starts with a 64-byte header {state u8, lease u8, generation u64}, the payload
follows. Who may change a region's state:

    FREE    -> WRITTEN  sender, on alloc
    WRITTEN -> FREE     sender, on free() or once the region's TTL passed untaken
    WRITTEN -> TAKEN    receiver, on take(): it also locks the region's lease byte
    TAKEN   -> FREE     receiver, when its last view dies (then unlocks the lease); or the
                        sender, when it can lock the lease (the reader died): it looks at
                        most every `dead_reader_probe_s`, and at once past the TTL

Every transition out of WRITTEN (and alloc's header write) happens under an exclusive
open-file-description lock (`F_OFD_SETLKW`) on the region's state byte, through each side's
own descriptor, so the sender's TTL free and the receiver's check-then-take cannot
interleave: a receiver gets the payload its handle names, or NotFound. The lease is a lock
the reader holds for as long as its views live; the kernel drops it when the reader's
process dies (kill -9 included), which is how the sender tells a dead reader from a slow one.
OFD locks belong to a descriptor, not a process, so a sender and receiver in one process
exclude each other too.
The sender's process registers the slab with Python's resource tracker, which unlinks it
even if the process dies; close() unlinks it at once.
"""
from __future__ import annotations

import bisect
import errno
import fcntl
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

from easerve.errors import NotFound
from easerve.transport import segments
from easerve.transport.shm_reclaim import owner_alive

REGION_HDR = 64
_HDR = struct.Struct("<B7xQ")  # state, (lease byte, padding), generation
_LEASE = 1  # offset of the lease byte in the region header
FREE, WRITTEN, TAKEN = 0, 1, 2
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid (0 for OFD locks)


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def _lock(fd: int, start: int, wait: bool = True) -> bool:
    """Exclusive OFD lock on byte `start`; False when `wait` is off and another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock(fd: int, start: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))


class SlabWriter:
    def __init__(self, name: str, size: int, dead_reader_probe_s: float = 1.0) -> None:
        self.name, self.size = name, _align(size)
        self.dead_reader_probe_s = dead_reader_probe_s
        self._next_probe = 0.0
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, flags=_FLAGS)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        self._fd = fd  # kept open: the region locks are taken through it
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
                _lock(self._fd, off)  # a receiver holding a stale handle must not see a torn header
                try:
                    _HDR.pack_into(self._mm, off, WRITTEN, gen)
                finally:
                    _unlock(self._fd, off)
                self._used[off] = (need, gen, time.monotonic() + ttl_s)
                return off + REGION_HDR, gen
        return None

    def buffer(self, payload_off: int, nbytes: int) -> memoryview:
        return memoryview(self._mm)[payload_off: payload_off + nbytes]

    def free(self, payload_off: int, generation: int) -> None:
        """Give back a region no receiver took (a region being read is left alone)."""
        off = payload_off - REGION_HDR
        entry = self._used.get(off)
        if entry and entry[1] == generation:
            self._transition(off, generation, untaken_too=True)
        self.reclaim()

    def reclaim(self) -> None:
        """Regions receivers freed, WRITTEN ones nobody took before their expiry, and TAKEN
        ones whose reader is gone (a killed decode instance must not pin its KV for a TTL)."""
        now = time.monotonic()
        probe = now >= self._next_probe
        if probe:
            self._next_probe = now + self.dead_reader_probe_s
        for off, (length, gen, expiry) in list(self._used.items()):
            state = self._mm[off]
            if state == WRITTEN and expiry <= now or state == TAKEN and (probe or expiry <= now):
                self._transition(off, gen, untaken_too=expiry <= now)
            if self._mm[off] == FREE:  # only this side leaves FREE: no lock needed to see it
                del self._used[off]
                self._insert_free(off, length)

    def _transition(self, off: int, gen: int, untaken_too: bool) -> None:
        """Under the region's lock: TAKEN -> FREE when the reader's lease is free (the lease
        is locked before TAKEN is written and let go after FREE is: its process died); with
        `untaken_too` also WRITTEN -> FREE."""
        _lock(self._fd, off)
        try:
            state, now_gen = _HDR.unpack_from(self._mm, off)
            if now_gen != gen:
                return
            if state == WRITTEN and untaken_too:
                self._mm[off] = FREE
            elif state == TAKEN and _lock(self._fd, off + _LEASE, wait=False):
                self._mm[off] = FREE
                _unlock(self._fd, off + _LEASE)
        finally:
            _unlock(self._fd, off)

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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is alive; the mapping goes with it


class _Mapped:
    """One receiver-side mapping of a slab and the descriptor its locks are held through;
    the descriptor closes when the last view (and so the last lease) is gone."""

    def __init__(self, name: str) -> None:
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise NotFound(f"slab {name!r} is gone (its sender closed or exited)") from None
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=_FLAGS)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)


class SlabReader:
    """Receiver side: maps each sender's slab once (the `max_slabs` most recent ones)."""

    def __init__(self, max_slabs: int = 16) -> None:
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._dropped: list[weakref.ref[_Mapped]] = []  # dead senders' slabs forgotten, maybe still viewed
        self.max_slabs = max_slabs

    def take(self, name: str, offset: int, size: int, generation: int) -> np.ndarray:
        """The region's payload bytes, marked TAKEN; FREE again once the array (and every
        view built on it) is gone."""
        m = self._map(name)
        off = offset - REGION_HDR
        if off < 0 or offset + size > len(m.mm):
            raise NotFound(f"region [{offset}, +{size}) lies outside slab {name!r} of {len(m.mm)} bytes")
        _lock(m.fd, off)
        try:
            state, gen = _HDR.unpack_from(m.mm, off)
            if gen != generation or state != WRITTEN:
                raise NotFound(f"slab {name!r} region at {offset} was already taken, released or reused "
                               f"(state {state}, generation {gen}, handle has {generation})")
            _lock(m.fd, off + _LEASE)  # a previous reader may be a step from letting go of it
            m.mm[off] = TAKEN
        finally:
            _unlock(m.fd, off)
        arr = np.frombuffer(m.mm, dtype=np.uint8, count=size, offset=offset)
        weakref.finalize(arr, _let_go, m, off)
        return arr

    @property
    def mapped(self) -> int:
        """How many slabs this reader maps now."""
        return len(self._maps)

    def drop_dead(self) -> list[str]:
        """Forget the slabs whose sender is gone (`_sender_gone`), so that their memory is freed
        once no view of them is left; their names."""
        gone = [n for n in self._maps if _sender_gone(n)]
        for name in gone:
            self._dropped.append(weakref.ref(self._maps.pop(name)))
        return gone

    @property
    def dead_held(self) -> int:
        """How many slabs `drop_dead` forgot are still mapped, because a view of them is alive."""
        self._dropped = [r for r in self._dropped if r() is not None]
        return len(self._dropped)

    def _map(self, name: str) -> _Mapped:
        if name in self._maps:
            self._maps.move_to_end(name)
            return self._maps[name]
        self.drop_dead()
        m = self._maps[name] = _Mapped(name)
        while len(self._maps) > self.max_slabs:  # views of an evicted slab keep it (and its fd) alive
            self._maps.popitem(last=False)
        return m

    def close(self) -> None:
        self._maps.clear()
        self._dropped.clear()


def _sender_gone(name: str) -> bool:
    """Whether a mapped slab's sender is gone: its name is unlinked (the sender closed it or a
    reclaim took it), or nobody holds the owner's lock of an owned slab (`shm_reclaim.claim`:
    the sender died). The receiver then unlinks that slab itself: the launcher's reclaim skips a
    slab younger than its `min_age_s`, and comes only with the next restart. A sender hands out
    a slab's regions only after claiming it, so a receiver never sees the unclaimed instant."""
    if not os.path.exists(f"/dev/shm/{name}"):
        return True
    if not name.endswith("-owned"):
        return False  # a slab of a version before the owner's lock: never taken for dead
    if owner_alive(f"/dev/shm/{name}"):
        return False
    segments.unlink(name)
    return True


def _let_go(m: _Mapped, off: int) -> None:
    """TAKEN -> FREE by the lease holder, then the lease goes (never blocks: it may run in
    any thread, at any garbage collection)."""
    try:
        m.mm[off] = FREE
    except ValueError:  # mapping already closed
        return
    _unlock(m.fd, off + _LEASE)
