"""One-off POSIX shared-memory segments: made by one process, mapped and unlinked by another.

The sender creates `<prefix>-<32 hex>` (the name `shm_reclaim.reclaim_stale` sweeps when its
receiver never came), writes into its mapping and passes the name on; the receiver opens it,
unlinks it at once and keeps only the mapping, whose memory lives until the mapping's last
view dies. Segments are made with `_posixshmem` (what multiprocessing.shared_memory uses) to
keep Python's resource tracker out of them. No torch and no grpc here: the media workers use
it too (easerve/media/shipping.py).
"""
from __future__ import annotations

import mmap
import os
import uuid

import _posixshmem

from easerve.errors import NotFound, Overloaded


def one_off_name(prefix: str = "easerve") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def free_bytes() -> int | None:
    """Free bytes of the tmpfs behind POSIX shm (None where there is no /dev/shm)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create(name: str, size: int, reserve: bool = False) -> mmap.mmap:
    """A new segment of `size` bytes, mapped. `reserve`: its pages are allocated now, so a full
    tmpfs is an Overloaded error here instead of a SIGBUS at the first write past its room."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        if reserve:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise Overloaded(f"/dev/shm has no room for {size} bytes ({e.strerror}); "
                                 "raise the container's shm_size") from None
        return mmap.mmap(fd, size)
    except BaseException:
        _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)


def open_and_unlink(name: str, size: int) -> mmap.mmap:
    """Map segment `name` (at least `size` bytes) and unlink it: nobody else can take it after."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise NotFound(f"shared memory segment {name!r} is gone (already received, released or expired)") from None
    try:
        _posixshmem.shm_unlink("/" + name)
        if os.fstat(fd).st_size < size:
            raise NotFound(f"segment {name!r} holds {os.fstat(fd).st_size} bytes, handle says {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Unlink `name` if it is still there (its receiver may have taken it)."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def close(mm: mmap.mmap) -> None:
    """Unmap now unless a view of it is still alive (then the mapping goes with the last view)."""
    try:
        mm.close()
    except BufferError:
        pass
