"""What the simulator is fed: one `SimRequest` per arrival (the workload adapter).

`hasctl simulate` builds them from `hasctl.workload`'s seeded arrival times and WorkloadSpec,
so a simulated run and `hasctl bench` replay the same schedule; tests build them directly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    modality: str          # image | video | audio | text
    media: str             # profile media label ("224x224", "8x112x112", "2s"; "" for text)
    text_tokens: int       # prompt tokens besides the media placeholders
    max_tokens: int        # output tokens (the simulator decodes all of them: EOS is not modelled)

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0:
            raise ValueError(f"request {self.index}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.text_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"request {self.index}: text_tokens and max_tokens must be >= 1")

    @property
    def has_media(self) -> bool:
        return self.modality != "text"


def piecewise_poisson(segments: list[tuple[float, float]], seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process whose rate is constant over each (duration_s, rate)
    segment in turn: a rate step is a few segments, a diurnal curve many short ones."""
    rng, out, start = random.Random(seed), [], 0.0
    for duration, rate in segments:
        if not duration >= 0 or not rate >= 0:
            raise ValueError(f"a segment needs duration >= 0 and rate >= 0, got ({duration}, {rate})")
        t, end = start, start + duration
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                break
            out.append(t)
        start = end
    return out
