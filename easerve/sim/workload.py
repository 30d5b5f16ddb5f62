"""What the simulator is fed: one `SimRequest` per arrival (the workload adapter), and each
one's state while it is simulated (`Req`).

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
    content: str = ""      # its media's identity (the gateway's content hash); "": unique to it
    tier: str = ""         # its SLO tier ("": the gateway's --slo-tier)
    priority: str = ""     # its priority class ("": the gateway's --priority)

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


class Req:
    """One request's state while it is simulated."""
    __slots__ = (
        "admission",
        "at_gateway",
        "decode",
        "done",
        "end",
        "error",
        "error_kind",
        "marks",
        "media_tokens",
        "prompt_tokens",
        "slo",
        "spec",
        "stage",
        "tokens",
    )

    def __init__(self, spec: SimRequest, media_tokens: int) -> None:
        self.spec = spec
        self.media_tokens = media_tokens
        self.prompt_tokens = spec.text_tokens + media_tokens
        self.tokens: list[float] = []
        self.end: float | None = None
        self.error: str | None = None
        self.error_kind: str | None = None
        self.done = False
        self.stage = None        # the instance holding it now (cancel(req) drops it there)
        self.decode = None       # the decode instance holding its reservation
        self.at_gateway = False
        self.admission = None    # the gateway admission's Decision (with --profile)
        self.slo: tuple[float, bool] | None = None  # (deadline, yields) the stages order it by
        self.marks: dict[str, float] = {}  # phase boundary -> when it was first crossed (easerve/sim/phases.py)

    def mark(self, what: str, at: float) -> None:
        self.marks.setdefault(what, at)

    def record(self) -> dict:
        """The fields of easerve.slo.RequestRecord.to_dict()."""
        s = self.spec
        ok = self.error is None
        return {"index": s.index, "modality": s.modality, "scheduled_s": s.arrival_s, "sent_s": s.arrival_s,
                "chunk_s": list(self.tokens) if ok else [], "end_s": self.end,
                "output_tokens": len(self.tokens) if ok else None, "prompt_tokens": self.prompt_tokens,
                "error": self.error, "error_kind": self.error_kind}
