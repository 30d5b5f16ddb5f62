"""bench/chaos_faults.py: the seeded fault schedule of the chaos soak."""
from __future__ import annotations

import pytest

from bench.chaos_faults import STAGES, Fault, schedule


def test_ten_minutes_has_the_issues_periods():
    faults = schedule(600, seed=7)
    by = {k: [f.at_s for f in faults if f.kind == k] for k in ("kill", "stop", "drain", "link_cut")}
    assert by["kill"] == [10.0 * i for i in range(1, 60)]
    assert by["stop"] == [30.0 * i + 5 for i in range(1, 20)]
    assert by["drain"] == [60.0 * i + 15 for i in range(1, 10)]
    assert not {f.at_s for f in faults if f.kind == "kill"} & {f.at_s for f in faults if f.kind != "kill"}
    assert len(by["link_cut"]) == 1 and 150 <= by["link_cut"][0] <= 450 - 20
    assert all(f.hold_s == 5.0 for f in faults if f.kind == "stop")
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert {f.stage for f in faults} == set(STAGES)


def test_same_seed_same_schedule_other_seed_other_targets():
    assert schedule(90, seed=1) == schedule(90, seed=1)
    assert [(f.stage, f.pick) for f in schedule(600, 1)] != [(f.stage, f.pick) for f in schedule(600, 2)]


def test_one_kinds_period_does_not_move_anothers_targets():
    kills = lambda fs: [f for f in fs if f.kind == "kill"]  # noqa: E731
    assert kills(schedule(600, 3)) == kills(schedule(600, 3, stop_every_s=7.0, drain_every_s=11.0))


def test_quick_run_fits_and_no_link_cut_when_too_short():
    quick = schedule(90, seed=0)
    assert [f.kind for f in quick].count("kill") == 8 and [f.kind for f in quick].count("drain") == 1
    assert all(f.at_s < 90 for f in quick)
    assert not [f for f in schedule(30, seed=0) if f.kind == "link_cut"]
    with pytest.raises(ValueError, match="duration_s"):
        schedule(0, seed=0)


def test_target_picks_among_the_running_names_whatever_their_order():
    f = Fault(10.0, "kill", "decode", pick=5)
    assert f.target(["decode-1", "decode-0"]) == "decode-1"
    assert f.target(["decode-0", "decode-1"]) == "decode-1"
    assert f.target(["decode-2", "decode-0", "decode-3"]) == "decode-3"
    assert f.target([]) is None


def test_leaks_compare_the_snapshots_and_fd_growth_names_process_and_kind():
    from bench.chaos import fd_growth, leaked
    before = {"in_flight": 0.0, "fds": 180, "shm_segments_unheld": 0,
              "fds_by_process": {"prefill-0": {"socket": 9, "/dev/shm": 4}, "decode-0": {"pipe": 4}}}
    after = {"in_flight": 0.0, "fds": 182, "shm_segments_unheld": 0,
             "fds_by_process": {"prefill-0": {"socket": 9, "/dev/shm": 6}, "decode-2": {"pipe": 4}}}
    assert leaked(before, after) == ["fds"] and leaked(after, before) == []
    assert fd_growth(before["fds_by_process"], after["fds_by_process"]) == {
        "decode-0": {"pipe": -4}, "decode-2": {"pipe": 4}, "prefill-0": {"/dev/shm": 2}}


def test_fds_on_dev_shm_count_apart_and_dead_segments_are_named():
    """A process's fd on a live owned slab is "/dev/shm"; on an owned slab nobody holds the
    owner's lock of, or an unlinked segment, "/dev/shm dead" (the leak the soak counts)."""
    import os

    from bench.chaos import _fd_kinds
    from easerve.transport import segments
    from easerve.transport.shm_reclaim import claim, release_claim, slab_name

    name = slab_name("easerve-t")
    mm = segments.create(name, 4096)
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)  # the receiver's view of it, in this process
    owner = claim(name)
    try:
        kinds = _fd_kinds(os.getpid())
        assert kinds.get("/dev/shm dead", 0) == 0 and kinds["/dev/shm"] >= 2  # fd and the owner's claim
        release_claim(owner)  # the owner died
        owner = None
        assert _fd_kinds(os.getpid())["/dev/shm dead"] == 2  # the fd and the mapping's own (mmap dups it)
        segments.unlink(name)  # reclaimed: still held, "(deleted)"
        assert _fd_kinds(os.getpid())["/dev/shm dead"] == 2
    finally:
        release_claim(owner)
        os.close(fd)
        segments.close(mm)
        segments.unlink(name)
    assert "/dev/shm dead" not in _fd_kinds(os.getpid())
