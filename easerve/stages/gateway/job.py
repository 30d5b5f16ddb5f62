"""A request as the gateway holds it from the door to its last token (`Job`), and the internal
id the stages know it by. Read by the gateway's core (easerve.stages.gateway.core), its
admission bookkeeping (easerve.stages.gateway.admission) and both fronts."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from easerve.cache.gateway import MediaPlan
from easerve.policy.admission import Decision
from easerve.stages.common.host_time import HostAccount
from easerve.types import ChatMessage, MediaPart, SamplingParams, media_parts, with_media


def new_internal_id() -> str:
    """A request id of the gateway's own, unique: what the stages see."""
    return f"gw-{uuid.uuid4().hex}"


@dataclass
class Job:
    """One request as the gateway sees it: chat messages or a raw prompt + media, as parsed at
    the door (media fetched, once `GatewayCore` did, never decoded in place).
    `request_id` is what the client sees; `internal_id`, unique, is what the stages see."""

    sampling: SamplingParams
    request_id: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    media: tuple[MediaPart, ...] = ()
    prompt_ids: list[int] | None = None  # a token-id prompt (/v1/completions), no media
    timeout_s: float | None = None
    received: float = field(default_factory=time.monotonic)
    internal_id: str = field(default_factory=new_internal_id)
    media_plan: MediaPlan | None = None  # set by preprocess when media are hashed (encoder cache)
    preprocess_ms: float = 0.0           # set by preprocess (and a late-miss re-preprocess)
    slo_tier: str | None = None          # None: the gateway's --slo-tier
    priority: str | None = None          # None: the gateway's --priority
    admission: Decision | None = None    # set at admission (with --profile)
    trace: dict | None = None            # its /trace record
    cached_tokens: int = 0               # set from prefill's first chunk (its prefix cache's hit)
    migrations: int = 0                  # times its stream moved to another decode instance
    host: HostAccount = field(default_factory=HostAccount)  # its host CPU seconds by phase (/trace)

    def media_parts(self) -> list[MediaPart]:
        """Every media part, in request order."""
        return [*media_parts(self.messages or ()), *self.media]

    def with_media(self, parts: list[MediaPart]) -> tuple[tuple[ChatMessage, ...] | None, tuple[MediaPart, ...]]:
        """(messages, media) of this job with its media parts (`media_parts()` order) replaced by `parts`."""
        n = len(parts) - len(self.media)
        messages = None if self.messages is None else with_media(self.messages, parts[:n])
        return messages, tuple(parts[n:])
