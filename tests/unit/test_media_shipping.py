"""Decoded media through shared memory (easerve.media.shipping): a large array travels as a
one-off segment that the receiver maps and unlinks, a small one (or one /dev/shm has no room
for) stays in the answer; nothing is left in /dev/shm."""
from __future__ import annotations

import os

import numpy as np
import pytest

from easerve.media import shipping
from easerve.media.shipping import SHIP_MIN_BYTES, Shipped, receive, ship
from tests.support.media import mapped as _mapped

needs_shm = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")


@needs_shm
def test_a_large_array_goes_through_a_segment_that_the_receiver_unlinks():
    frames = np.random.default_rng(0).integers(0, 255, (8, 720, 1280, 3), dtype=np.uint8)  # 22 MB
    assert frames.nbytes >= SHIP_MIN_BYTES
    s = ship(frames)
    assert isinstance(s, Shipped) and s.shape == frames.shape and s.nbytes == frames.nbytes
    assert os.path.exists(f"/dev/shm/{s.name}")
    got = receive(s)
    assert not os.path.exists(f"/dev/shm/{s.name}")  # unlinked on receipt: the mapping holds the memory
    assert _mapped(got) and np.array_equal(got, frames) and got.dtype == frames.dtype
    audio = np.linspace(-1, 1, SHIP_MIN_BYTES // 4 + 7, dtype=np.float32)
    back = receive(ship(audio))
    assert _mapped(back) and np.array_equal(back, audio)


def test_small_arrays_and_a_full_dev_shm_stay_in_the_answer(monkeypatch):
    small = np.zeros((100, 100, 3), np.uint8)
    assert ship(small) is small and receive(small) is small
    big = np.ones(SHIP_MIN_BYTES, np.uint8)
    monkeypatch.setattr(shipping.segments, "free_bytes", lambda: big.nbytes + shipping.SHM_HEADROOM - 1)
    assert ship(big) is big  # would leave less than the headroom free
    monkeypatch.setattr(shipping.segments, "free_bytes", lambda: None)
    assert ship(big) is big  # no /dev/shm
