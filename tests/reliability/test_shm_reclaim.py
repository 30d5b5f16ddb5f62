"""Stale shm slabs of killed senders are reclaimed; live ones are not (real processes,
real /dev/shm, a prefix of the test's own so nothing else on the host is touched)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _posixshmem
import pytest

from easerve.transport.shm_reclaim import claim, reclaim_stale, release_claim, slab_name

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")

# a sender process: one KV-sized send through ShmTransport creates (and claims) its slab
_SENDER = r"""
import asyncio, sys, torch
from easerve.wire import codec
from easerve.transport.shm import ShmConfig, ShmTransport
async def main():
    t = ShmTransport(ShmConfig(prefix=sys.argv[1], slab_bytes=8 << 20))
    h = await t.send("r1", codec.make_header("tensors", {}, [torch.ones(1024)]), [torch.ones(1024)])
    print(h.name, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.fixture
def prefix():
    p = f"t{uuid.uuid4().hex[:10]}"
    yield p
    for f in SHM.glob(p + "-*"):
        f.unlink(missing_ok=True)


def _sender(prefix: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, prefix], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ})
    name = proc.stdout.readline().strip()
    assert name.startswith(f"{prefix}-slab-") and name.endswith("-owned"), name
    return proc, name


def _killpg(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the sender and its resource tracker together
    proc.wait()
    proc.stdout.close()


def test_slab_of_a_killed_process_group_is_reclaimed_and_a_live_one_is_not(prefix):
    live, live_name = _sender(prefix)
    dead, dead_name = _sender(prefix)
    try:
        _killpg(dead)
        time.sleep(0.5)
        assert (SHM / dead_name).exists(), "the resource tracker died too: the slab is left behind"
        out = reclaim_stale(prefix, min_age_s=0.0)
        assert out.names == (dead_name,)
        assert out.bytes >= 8 << 20
        assert not (SHM / dead_name).exists()
        assert (SHM / live_name).exists(), "a live sender's slab was taken for stale"
        assert reclaim_stale(prefix, min_age_s=0.0).names == ()
    finally:
        _killpg(live)


def test_an_unclaimed_slab_is_left_alone_while_young(prefix):
    name = slab_name(prefix)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    os.close(fd)  # created, not (yet) claimed: the instant between a sender's create and claim
    assert reclaim_stale(prefix, min_age_s=10.0).names == ()
    assert reclaim_stale(prefix, min_age_s=10.0, now=time.time() + 11).names == (name,)


def test_claimed_slab_survives_until_the_claim_is_released(prefix):
    name = slab_name(prefix)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    os.close(fd)
    lock = claim(name)
    assert reclaim_stale(prefix, min_age_s=0.0).names == ()
    release_claim(lock)
    assert reclaim_stale(prefix, min_age_s=0.0).names == (name,)


def test_one_off_segments_go_after_their_maximum_age_and_foreign_names_never(prefix):
    one_off, foreign, old_style = f"{prefix}-{uuid.uuid4().hex}", f"{prefix}-other", f"{prefix}-slab-{uuid.uuid4().hex}"
    for n in (one_off, foreign, old_style):
        os.close(_posixshmem.shm_open("/" + n, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600))
    assert reclaim_stale(prefix, min_age_s=0.0, one_off_max_age_s=300.0).names == ()
    later = time.time() + 301
    assert reclaim_stale(prefix, min_age_s=0.0, one_off_max_age_s=300.0, now=later).names == (one_off,)
    assert (SHM / foreign).exists() and (SHM / old_style).exists()  # not ours to judge


def test_prefix_must_be_a_plain_name():
    with pytest.raises(ValueError, match="without '/'"):
        reclaim_stale("a/b")


def test_a_reader_lets_go_of_a_reclaimed_slab_when_it_maps_the_next_one(prefix):
    from easerve.transport.shm_slab import SlabReader, SlabWriter

    def mapped(name: str) -> bool:
        return any(name in line for line in Path("/proc/self/maps").read_text().splitlines())

    reader, old, new = SlabReader(), SlabWriter(slab_name(prefix), 1 << 20), SlabWriter(slab_name(prefix), 1 << 20)
    try:
        off, gen = old.alloc(128, ttl_s=60)
        reader.take(old.name, off, 128, gen)  # the array, its only view, dies at once
        old.close()  # the sender is gone: its slab is unlinked
        assert mapped(old.name), "the reader should still map the unlinked slab"
        off, gen = new.alloc(128, ttl_s=60)
        arr = reader.take(new.name, off, 128, gen)
        assert not mapped(old.name), "the reader still maps a slab whose sender is gone"
        del arr
    finally:
        new.close()
        reader.close()
