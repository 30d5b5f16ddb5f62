"""Decoded media from a decode worker to the gateway through shared memory, not the pipe.

A worker's answer goes back through the process pool's pipe pickled: for the 32 sampled frames
of a 720p video (88 MB) that is a serialization, a write and a read of every byte and an
unpickling copy, the last two on the gateway's own CPU, the unpickling under its GIL. Instead
the worker `ship`s an array of at least `SHIP_MIN_BYTES` into a one-off segment
(easerve/transport/segments.py) and returns a `Shipped` (name, shape, dtype) in its place; the
gateway's `receive` maps the segment, unlinks it at once and wraps the mapping as the array: one
copy in the worker, none in the gateway. Below SHIP_MIN_BYTES the pipe costs less in all (a
fresh segment's pages are allocated and zeroed, then copied into, in the worker; a 1080p image's
6 MB measured dearer that way, 8 frames of 720p, 22 MB, cheaper: `bench/host_path.py` media,
`ours_core_ms` and `ours_gateway_core_ms`). Where /dev/shm lacks room for the array plus
`SHM_HEADROOM` (the KV transport's slabs live there too), the array goes through the pipe as
before. A segment whose answer never reaches the gateway (the gateway died in between) has the
one-off name `shm_reclaim.reclaim_stale` sweeps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from easerve.errors import Overloaded
from easerve.transport import segments

SHIP_MIN_BYTES = 16 << 20  # smaller arrays: the pipe costs less in all (see the module docstring)
SHM_HEADROOM = 256 << 20   # /dev/shm left free after a shipped array, else the pipe


@dataclass(frozen=True)
class Shipped:
    """An array waiting in shared-memory segment `name`."""
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def ship(array: np.ndarray) -> np.ndarray | Shipped:
    """In a worker: `array` copied into a new segment, or `array` itself when it is small or
    /dev/shm has no room for it."""
    if array.nbytes < SHIP_MIN_BYTES:
        return array
    free = segments.free_bytes()
    if free is None or free - array.nbytes < SHM_HEADROOM:
        return array
    name = segments.one_off_name()
    try:
        mm = segments.create(name, array.nbytes, reserve=True)
    except (Overloaded, OSError):
        return array
    try:
        np.frombuffer(mm, dtype=array.dtype, count=array.size).reshape(array.shape)[...] = array
    except BaseException:
        segments.unlink(name)
        raise
    finally:
        segments.close(mm)
    return Shipped(name, tuple(array.shape), array.dtype.str)


def receive(item: np.ndarray | Shipped) -> np.ndarray:
    """In the gateway: the array of a `Shipped` (its segment mapped and unlinked; the memory
    is freed with the array's last view), or `item` itself."""
    if not isinstance(item, Shipped):
        return item
    mm = segments.open_and_unlink(item.name, item.nbytes)
    return np.frombuffer(mm, dtype=np.dtype(item.dtype), count=math.prod(item.shape)).reshape(item.shape)
