"""The fault schedule of bench/chaos.py: a pure function of (run length, seed).

Every `kill_every_s` a kill -9, every `stop_every_s` a SIGSTOP held `stop_s` (STOP_PHASE_S
later in each period), every `drain_every_s` a drain (DRAIN_PHASE_S later; the instance is
removed, then one is added back), each of a stage drawn at random; and one `link_cut_s` window cutting a stage's link, placed at random in the middle
half of the run. A fault names its stage and `pick`, an integer that chooses among the stage's
instances running when it fires (`target`): names change as instances are drained and added,
so the schedule cannot name them in advance. Each kind draws from its own seeded stream, so the
targets of one kind do not move when another kind's period changes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

STAGES = ("encode", "prefill", "decode")
KINDS = ("kill", "stop", "drain", "link_cut")
STOP_PHASE_S, DRAIN_PHASE_S = 5.0, 15.0  # stops and drains fire between kills, not on the same tick


@dataclass(frozen=True)
class Fault:
    at_s: float      # seconds after the run's start
    kind: str        # one of KINDS
    stage: str       # one of STAGES
    pick: int        # chooses the instance: target(running names)
    hold_s: float = 0.0  # stop: until SIGCONT; link_cut: the window's length

    def target(self, running: Sequence[str]) -> str | None:
        """The instance of `running` (names) this fault hits; None when none is running."""
        names = sorted(running)
        return names[self.pick % len(names)] if names else None


def schedule(duration_s: float, seed: int, *, kill_every_s: float = 10.0, stop_every_s: float = 30.0,
             stop_s: float = 5.0, drain_every_s: float = 60.0, link_cut_s: float = 20.0) -> list[Fault]:
    """The faults of a run of `duration_s`, in firing order (ties: KINDS order)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    out: list[Fault] = []
    for kind, every, hold, phase in (("kill", kill_every_s, 0.0, 0.0), ("stop", stop_every_s, stop_s, STOP_PHASE_S),
                                     ("drain", drain_every_s, 0.0, DRAIN_PHASE_S)):
        rng = random.Random(f"{seed}-{kind}")
        t = every + phase
        while t < duration_s:
            out.append(Fault(t, kind, rng.choice(STAGES), rng.randrange(1 << 16), hold))
            t += every
    if link_cut_s and duration_s > 2 * link_cut_s:
        rng = random.Random(f"{seed}-link_cut")
        start = round(duration_s / 4 + rng.random() * (duration_s / 2 - link_cut_s), 3)
        out.append(Fault(start, "link_cut", rng.choice(STAGES), rng.randrange(1 << 16), link_cut_s))
    return sorted(out, key=lambda f: (f.at_s, KINDS.index(f.kind)))
