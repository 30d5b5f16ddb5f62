"""The launcher's port picks: outside the kernel's ephemeral range, never a held port, no repeats."""
from __future__ import annotations

import socket

import hasctl.launch as launch
from hasctl.launch import ephemeral_ports, free_port


def test_picks_are_outside_the_ephemeral_range_where_outgoing_connections_take_ports():
    eph = ephemeral_ports()
    picks = [free_port() for _ in range(300)]
    assert not [p for p in picks if p in eph]
    assert len(set(picks)) == len(picks)  # not handed out twice while the first may be unbound


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]

        class Draws:
            seq = iter([taken, 12345])

            def choice(self, _pool):
                return next(self.seq)

        monkeypatch.setattr(launch.random, "SystemRandom", Draws)
        monkeypatch.setattr(launch, "_PICKED", {})
        assert free_port() == 12345


def test_the_range_is_read_from_the_kernel_and_the_larger_side_is_used(tmp_path, monkeypatch):
    f = tmp_path / "range"
    f.write_text("12000\t60999\n")
    assert ephemeral_ports(str(f)) == range(12000, 61000)
    monkeypatch.setattr(launch, "ephemeral_ports", lambda path=str(f): range(12000, 61000))
    assert all(p >= 61000 for p in (free_port() for _ in range(50)))
    assert ephemeral_ports(str(tmp_path / "missing")) == range(32768, 61000)
