"""Stale shared-memory segments of dead processes: find and unlink them.

A sender's slab is 256 MiB of /dev/shm. Python's resource tracker unlinks it when its
process dies, but not when the tracker dies with it (kill -9 of the process group, which is
what the launcher does to a dead stage's leftovers, or an OOM kill of the tracker): the slab
stays until the host reboots. So:

- `slab_name(prefix)`: `<prefix>-slab-<hex>-owned`; the suffix says the owner holds a lock
  on it (slabs named without it, by versions before this rule, are never taken for stale).
- `claim(name)`: the owner opens its own segment once more and holds an exclusive `flock`
  on it for its whole life; the kernel drops the lock when the process dies, however it
  dies (locks live on the inode, so this holds across PID namespaces sharing one /dev/shm).
- `reclaim_stale(prefix)`: unlinks every owned slab whose lock nobody holds
  and that is older than `min_age_s` (a slab is claimed right after its creation; the age
  keeps a cleaner off a slab in that instant), and every one-off segment `<prefix>-<hex>`
  older than `one_off_max_age_s` (a live sender reclaims its own after its TTL anyway).

Called by a sender before it creates its slab (the next start of a stage) and by the
launcher before it restarts a stage. A receiver that still maps an unlinked slab keeps
its memory until it drops the mapping.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass

import _posixshmem

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Reclaimed:
    names: tuple[str, ...] = ()
    bytes: int = 0


def slab_name(prefix: str) -> str:
    return f"{prefix}-slab-{uuid.uuid4().hex}-owned"


def claim(name: str) -> int:
    """Hold the owner's lock on segment `name` (created by this process); returns the fd,
    which must stay open while the segment is in use (closing it releases the lock)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_claim(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def owner_alive(path: str) -> bool:
    """Whether someone holds the owner's lock on the segment at `path` (a gone one: yes, nothing to do)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # gone already: nothing to do
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock we may just have taken
    return False


def reclaim_stale(prefix: str = "easerve", *, min_age_s: float = 10.0, one_off_max_age_s: float = 300.0,
                  shm_dir: str = SHM_DIR, now: float | None = None) -> Reclaimed:
    """Unlink the stale segments named with `prefix` (see the module docstring)."""
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty name without '/', got {prefix!r}")
    slab = re.compile(rf"{re.escape(prefix)}-slab-[0-9a-f]{{32}}-owned")
    one_off = re.compile(rf"{re.escape(prefix)}-[0-9a-f]{{32}}")
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return Reclaimed()  # no /dev/shm here
    now = time.time() if now is None else now
    names, freed = [], 0
    for e in entries:
        is_slab = slab.fullmatch(e.name) is not None
        if not is_slab and one_off.fullmatch(e.name) is None:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        age = now - max(st.st_mtime, st.st_ctime)
        if is_slab and (age < min_age_s or owner_alive(e.path)):
            continue
        if not is_slab and age < one_off_max_age_s:
            continue
        try:
            _posixshmem.shm_unlink("/" + e.name)
        except FileNotFoundError:
            continue
        names.append(e.name)
        freed += st.st_size
    if names:
        log.warning("reclaimed %d stale shared-memory segment(s) of dead processes (%d MiB): %s",
                    len(names), freed >> 20, ", ".join(names))
    return Reclaimed(tuple(names), freed)
