"""The shm slab's free and take do not race: a sender expiring regions (TTL) and freeing
them while a receiver takes them never hands the receiver bytes of another payload.

Each payload is the region's generation repeated, so a receiver that holds a region the
sender freed and rewrote sees a different number: that is the corruption this guards
against. Every take ends one of two ways: the right bytes, or NotFound (a clear error).
The stress variants (sender and receiver as threads of one process with a 1 us GIL switch
interval, and as two real processes; the sender spinning on its TTL sweep right after each
handle) race the two sides at random; the interleaving that corrupted KV before the region
locks (the receiver frozen between its check and its mark) is also made deterministic.
Before the locks, the process stress saw 3 corrupt payloads in 3,000 in one of four runs;
the deterministic test and the kill -9 one failed every time.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import threading
import time
import uuid

import _posixshmem
import numpy as np

from easerve.errors import NotFound
from easerve.transport import shm_slab
from easerve.transport.shm_slab import SlabReader, SlabWriter

PREFIX = "easerve-race"
PAYLOAD = 4096
REGIONS = 16


def names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}


def fill(w: SlabWriter, off: int, gen: int) -> None:
    np.frombuffer(w.buffer(off, PAYLOAD), dtype=np.uint64)[:] = gen


def check(arr: np.ndarray, gen: int) -> bool:
    """The payload is still wholly this generation's (read twice, around a yield)."""
    words = arr.view(np.uint64)
    first = bool((words == gen).all())
    time.sleep(1e-4)
    return first and bool((words == gen).all())


def send_loop(w: SlabWriter, n: int, put, rng: random.Random) -> int:
    """Allocate n payloads with TTLs around the receiver's latency (so many expire while it
    takes them), sometimes free one at once, as a sender giving up would. Returns sent."""
    sent = 0
    while sent < n:
        slot = w.alloc(PAYLOAD, ttl_s=rng.uniform(1e-5, 2e-3))
        if slot is None:
            time.sleep(0)
            continue
        off, gen = slot
        fill(w, off, gen)
        put((off, gen))
        if rng.random() < 0.1:
            w.free(off, gen)  # released by the sender while the receiver may be taking it
        spin = time.monotonic() + rng.uniform(0, 1e-3)
        while time.monotonic() < spin:  # expire regions while the receiver is taking them
            w.reclaim()
        sent += 1
    return sent


def take_one(r: SlabReader, name: str, off: int, gen: int, counts: dict) -> None:
    try:
        arr = r.take(name, off, PAYLOAD, gen)
    except NotFound:
        counts["not_found"] += 1
        return
    counts["ok" if check(arr, gen) else "corrupt"] += 1
    del arr  # the finalizer hands the region back


def test_ttl_free_and_take_threads_never_corrupt():
    w = SlabWriter(f"{PREFIX}-{uuid.uuid4().hex[:8]}", REGIONS * (PAYLOAD + 64))
    r, q = SlabReader(), queue.Queue()
    counts = {"ok": 0, "not_found": 0, "corrupt": 0}
    n = 2000

    def receive():
        for _ in range(n):
            off, gen = q.get()
            take_one(r, w.name, off, gen, counts)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        t = threading.Thread(target=receive)
        t.start()
        send_loop(w, n, q.put, random.Random(1))
        t.join(120)
        assert not t.is_alive()
    finally:
        sys.setswitchinterval(old)
        r.close()
        w.close()
    assert counts["corrupt"] == 0, counts
    assert counts["ok"] > 0 and counts["not_found"] > 0, f"no interleaving was exercised: {counts}"
    assert counts["ok"] + counts["not_found"] == n
    assert names() == set()


def _receiver(name: str, conn) -> None:
    r = SlabReader()
    counts = {"ok": 0, "not_found": 0, "corrupt": 0}
    while (msg := conn.recv()) is not None:
        take_one(r, name, *msg, counts)
    conn.send(counts)


def test_ttl_free_and_take_two_processes_never_corrupt():
    w = SlabWriter(f"{PREFIX}-{uuid.uuid4().hex[:8]}", REGIONS * (PAYLOAD + 64))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(w.name, child), daemon=True)
    proc.start()
    n = 2000
    try:
        send_loop(w, n, parent.send, random.Random(2))
        parent.send(None)
        assert parent.poll(120), "the receiver did not report"
        counts = parent.recv()
        proc.join(30)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        w.close()
    assert counts["corrupt"] == 0, counts
    assert counts["ok"] > 0 and counts["ok"] + counts["not_found"] == n, counts
    assert names() == set()


def test_a_take_between_its_check_and_its_mark_holds_off_the_ttl_free():
    """The interleaving that corrupted KV, made deterministic: a receiver has checked the
    region (WRITTEN, its generation) and not yet marked it TAKEN when the TTL passes. The
    sender's free now waits for it, and the region stays the receiver's."""
    w = SlabWriter(f"{PREFIX}-{uuid.uuid4().hex[:8]}", 2 * (PAYLOAD + 64))
    fd = _posixshmem.shm_open("/" + w.name, os.O_RDWR, mode=0o600)
    try:
        off, gen = w.alloc(PAYLOAD, ttl_s=0.01)
        fill(w, off, gen)
        hdr = off - shm_slab.REGION_HDR
        shm_slab._lock(fd, hdr)  # the receiver's take, up to its check
        assert shm_slab._HDR.unpack_from(w.buffer(0, hdr + 16), hdr) == (shm_slab.WRITTEN, gen)
        time.sleep(0.05)  # past the TTL
        reclaim = threading.Thread(target=w.reclaim)
        reclaim.start()
        reclaim.join(0.5)
        assert reclaim.is_alive(), "the TTL free did not wait for the take in progress"
        shm_slab._lock(fd, hdr + shm_slab._LEASE)  # ... the rest of the take: lease, mark TAKEN
        os.pwrite(fd, bytes([shm_slab.TAKEN]), hdr)
        shm_slab._unlock(fd, hdr)
        reclaim.join(10)
        assert not reclaim.is_alive() and w.used_bytes == PAYLOAD + 64, "the sender freed a taken region"
        other = w.alloc(PAYLOAD, ttl_s=1)
        assert other is not None and other[0] != off  # the taken region is not handed out again
    finally:
        os.close(fd)
        w.close()
    assert names() == set()


def _taker(name: str, off: int, gen: int, conn) -> None:
    r = SlabReader()
    arr = r.take(name, off, PAYLOAD, gen)
    conn.send(bool(check(arr, gen)))
    time.sleep(600)  # holds the view until killed


def test_region_of_a_reader_killed_mid_read_is_reclaimed_long_before_its_ttl():
    """kill -9 of a receiver holding a region (a decode instance killed with KV in hand): the
    sender takes it back at its next look for dead readers, not a 10-minute TTL later; while
    the reader lives, the region stays its own however often the sender looks."""
    w = SlabWriter(f"{PREFIX}-{uuid.uuid4().hex[:8]}", 2 * (PAYLOAD + 64), dead_reader_probe_s=0.0)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    try:
        off, gen = w.alloc(PAYLOAD, ttl_s=600)
        fill(w, off, gen)
        proc = ctx.Process(target=_taker, args=(w.name, off, gen, child), daemon=True)
        proc.start()
        assert parent.poll(120) and parent.recv() is True
        for _ in range(3):  # the reader alive: looked at, its region stays taken
            w.reclaim()
        w.free(off, gen)  # the sender's release after the handoff leaves a read region alone
        assert w.used_bytes == PAYLOAD + 64
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        w.reclaim()
        assert w.used_bytes == 0
        assert w.alloc(PAYLOAD, ttl_s=1) is not None and w.alloc(PAYLOAD, ttl_s=1) is not None
    finally:
        w.close()
    assert names() == set()
