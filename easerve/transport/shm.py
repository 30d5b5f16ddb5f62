"""Same-host transport through POSIX shared memory.

Default path: a slab the sender creates once and reuses (`shm_slab`, whose region locks keep
the sender's TTL free and the receiver's take apart), so a warm transfer is
one copy into already-mapped memory and the receiver gets views of it, no copy (or copies,
`copy_out=True`); the region is recycled when the receiver's last view dies.
Fallback (slab full, payload too large, or `slab_bytes=0`): a one-off segment of exactly the
frame's size; the receiver maps it and unlinks it at once (the memory lives while mapped).
Nothing leaks: the receiver unlinks one-off segments on recv; the sender unlinks the ones
not taken on `release(handle)`, on `close()` and after `ttl_s`; the slab is unlinked on
close() and, should the process die, by Python's resource tracker (should the tracker die
with it, by the next sender or the launcher: `shm_reclaim`). Segments are made with
`segments` (`_posixshmem`, what multiprocessing.shared_memory uses) to keep the tracker out of one-offs.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from easerve.wire import codec
from easerve.errors import InvalidRequest, Overloaded
from easerve.transport.base import KVTransport, off_loop
from easerve.transport import segments
from easerve.transport.handles import Handle, ShmHandle
from easerve.transport.shm_reclaim import claim, reclaim_stale, release_claim, slab_name
from easerve.transport.shm_slab import SlabReader, SlabWriter

log = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
_MAX_REGION = 1 << 48
TIDY_S = 1.0  # a receiver looks this often for the slabs of senders gone (while it maps any)
DEAD_GC_S = 10.0  # while a dead sender's slab is still viewed, a full garbage collection at most this often


@dataclass(frozen=True)
class ShmConfig:
    prefix: str = "easerve"
    slab_bytes: int = 256 << 20  # sender's reusable slab (0: one-off segments only)
    ttl_s: float = 120.0  # sender reclaims payloads nobody took within this time
    copy_out: bool = False  # receiver copies into private memory instead of viewing the segment

    def __post_init__(self) -> None:
        if not self.prefix or "/" in self.prefix or len(self.prefix) > 64:
            raise ValueError(f"prefix must be 1-64 chars without '/', got {self.prefix!r}")
        if self.slab_bytes < 0:
            raise ValueError(f"slab_bytes must be >= 0 (0 disables the slab), got {self.slab_bytes}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {self.ttl_s}")


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, config: ShmConfig = ShmConfig()) -> None:
        super().__init__()
        self.config = config
        self._pending: dict[str, tuple[float, int]] = {}  # one-off segment -> (expiry, bytes), sender side
        self._slab: SlabWriter | None = None
        self._slab_off = False
        self._slab_claim: int | None = None  # fd holding the owner's lock on the slab (shm_reclaim)
        self._reader = SlabReader()
        self._tidy: asyncio.TimerHandle | None = None
        self._collected_at = float("-inf")

    @property
    def pending(self) -> list[str]:
        """Segments this sender created that it has not released yet."""
        return list(self._pending)

    @property
    def held_bytes(self) -> int:
        """Slab regions not yet given back (after reclaiming what receivers let go of) plus
        one-off segments not yet released."""
        slab = 0
        if self._slab is not None:
            self._slab.reclaim()
            slab = self._slab.used_bytes
        return slab + sum(size for _, size in self._pending.values())

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> ShmHandle:
        self._sweep()
        t0 = time.perf_counter()
        size = codec.frame_size(header)
        slot = self._slab_alloc(size)
        if slot is not None:
            offset, gen = slot
            try:
                await off_loop(size, codec.write_parts, header, tensors, self._slab.buffer(offset, size))
            except BaseException:
                self._slab.free(offset, gen)
                raise
            handle = ShmHandle(request_id, self._slab.name, offset, size, slab=True, generation=gen)
        else:
            handle = ShmHandle(request_id, await self._send_segment(header, tensors, size), 0, size)
        self._measured(size, t0)
        return handle

    def _slab_alloc(self, size: int) -> tuple[int, int] | None:
        if self.config.slab_bytes == 0 or size > self.config.slab_bytes:
            return None
        if self._slab is None:
            free = segments.free_bytes()
            if free is not None and free < 2 * self.config.slab_bytes:  # a full tmpfs means SIGBUS
                log.warning("/dev/shm has %d bytes free, too little for a %d-byte slab: using one-off "
                            "segments (raise the container's shm_size)", free, self.config.slab_bytes)
                self._slab_off = True
            if self._slab_off:
                return None
            self._new_slab()
        return self._slab.alloc(size, self.config.ttl_s)

    def _new_slab(self) -> None:
        """Create this sender's slab, first unlinking the stale ones of dead senders, and hold
        the owner's lock on it so that no other process takes it for stale."""
        reclaim_stale(self.config.prefix, one_off_max_age_s=self.config.ttl_s + 60.0)
        self._slab = SlabWriter(slab_name(self.config.prefix), self.config.slab_bytes)
        self._slab_claim = claim(self._slab.name)

    async def _send_segment(self, header: bytes, tensors: Sequence[torch.Tensor], size: int) -> str:
        free = segments.free_bytes()
        if free is not None and size > free:
            raise Overloaded(f"/dev/shm has {free} bytes free, the payload needs {size} "
                             "(raise the container's shm_size)")
        name = segments.one_off_name(self.config.prefix)
        mm = segments.create(name, size)
        self._pending[name] = (time.monotonic() + self.config.ttl_s, size)
        try:
            await off_loop(size, _write, header, tensors, mm)
        except BaseException:
            self._unlink(name)
            raise
        finally:
            segments.close(mm)
        return name

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, ShmHandle)
        check_handle(handle)
        t0 = time.perf_counter()
        copy = self.config.copy_out
        if handle.slab:
            buf = self._reader.take(handle.name, handle.offset, handle.size, handle.generation)
            self._tidy_later()
            out = await off_loop(handle.size if copy else 0, codec.split_parts, buf, copy=copy)
        else:
            mm = segments.open_and_unlink(handle.name, handle.offset + handle.size)
            self._pending.pop(handle.name, None)
            buf = memoryview(mm)[handle.offset: handle.offset + handle.size]
            out = await off_loop(handle.size if copy else 0, codec.split_parts, buf, copy=copy)
            if copy:
                del buf
                segments.close(mm)
        self._measured(handle.size, t0)
        return out

    def release(self, handle: Handle) -> None:
        if not isinstance(handle, ShmHandle):
            return
        if not handle.slab:
            self._unlink(handle.name)
        elif self._slab is not None and handle.name == self._slab.name:
            self._slab.free(handle.offset, handle.generation)

    async def close(self) -> None:
        for name in list(self._pending):
            self._unlink(name)
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        release_claim(self._slab_claim)
        self._slab_claim = None
        if self._tidy is not None:
            self._tidy.cancel()
            self._tidy = None
        self._reader.close()

    def _tidy_later(self) -> None:
        """While this receiver maps any slab, every TIDY_S it forgets those of senders gone
        (`SlabReader.drop_dead`): a dead sender's slab (256 MiB of /dev/shm) is freed within
        a second or two, not when the next new slab happens to arrive. Its mapping goes with
        its last view; a view held only by a reference cycle (a failed call's traceback and
        frames) would wait for a garbage collection that an idle process never runs, so while
        a forgotten slab is still mapped, a full collection runs at most every DEAD_GC_S."""
        if self._tidy is None and (self._reader.mapped or self._reader.dead_held):
            self._tidy = asyncio.get_running_loop().call_later(TIDY_S, self._tidy_now)

    def _tidy_now(self) -> None:
        self._tidy = None
        self._reader.drop_dead()
        if self._reader.dead_held and time.monotonic() - self._collected_at >= DEAD_GC_S:
            self._collected_at = time.monotonic()
            gc.collect()
        self._tidy_later()

    def _sweep(self) -> None:
        now = time.monotonic()
        for name, (expiry, _) in list(self._pending.items()):
            if expiry <= now:
                self._unlink(name)

    def _unlink(self, name: str) -> None:
        self._pending.pop(name, None)
        segments.unlink(name)  # unless the receiver took it


def check_handle(h: ShmHandle) -> None:
    """InvalidRequest unless the handle could name a segment a sender of this transport made:
    a plain name (no '/', no NUL, no leading dot) and a region of sane size."""
    if not _NAME.fullmatch(h.name):
        raise InvalidRequest(f"shm segment name {h.name[:80]!r} is not one this transport makes "
                             "(1-255 characters of A-Z a-z 0-9 . _ -, not starting with '.')")
    if h.size < 1 or h.offset + h.size > _MAX_REGION:
        raise InvalidRequest(f"shm region [{h.offset}, +{h.size}) is empty or past {_MAX_REGION} bytes")


def _write(header: bytes, tensors: Sequence[torch.Tensor], mm: mmap.mmap) -> None:
    with memoryview(mm) as view:
        codec.write_parts(header, tensors, view)
