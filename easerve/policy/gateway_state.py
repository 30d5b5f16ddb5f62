"""What the gateway's admission sees of the stages: a `LiveState` from each instance's last load
report plus what the gateway knows itself (easerve/stages/gateway/admission.py describes the rule).

Pure and torch-free: the live gateway passes its `Peers`' up instances (easerve/stages/common/peers.py
`Peer`), the simulator its report views (easerve/sim/reports.py); both hold the fields of
`PeerLoad`. `Unserved` is one admitted request with no first token yet.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from easerve.policy.admission import TierLimits
from easerve.policy.latency import DecodeState, EncodeState, LiveState, PrefillState
from easerve.policy.slo_order import can_meet


class PeerLoad(Protocol):
    """One instance as its caller last saw it (its last `Stage/Load` answer, and the calls the
    caller started on it since)."""
    polled_at: float
    reported: int
    queued: int
    overdue: int
    kv_free_tokens: int
    sent_since_poll: int
    recent_batch_s: float
    recent_batch_size: float


@dataclass
class Unserved:
    """An admitted request with no first token yet: its first stage, whether it was sent there,
    and its place in the queues' deadline order (easerve/policy/slo_order.py)."""
    stage: str
    deadline: float
    yields: bool
    placed: bool = False

    def overdue(self, now: float) -> bool:
        return not can_meet((self.deadline, self.yields), now)


def share(n: int, instances: int) -> int:
    """Each instance's part of `n` requests spread evenly (rounded up)."""
    return -(-n // instances) if instances and n > 0 else 0


def tier_limits(profile: Any, name: str, modality: str) -> TierLimits:
    """The profile's tier `name` for `modality`, in seconds."""
    ttft_ms, tpot_ms = profile.slo(name).limits(modality)
    return TierLimits(ttft_ms / 1e3, tpot_ms / 1e3, name)


def live_state(enc: Sequence[PeerLoad], pre: Sequence[PeerLoad], dec: Sequence[PeerLoad],
               waiting: Iterable[Unserved], now: float, encode_batch: int, prefill_tokens: int) -> LiveState:
    """The state admission predicts from: the up instances of each stage, the admitted requests
    with no first token yet (`waiting`), the clock's time `now`; `encode_batch` /
    `prefill_tokens`: the gateway's --admission-encode-batch / --admission-prefill-tokens."""
    waiting = list(waiting)
    polled = [p.polled_at for p in (*enc, *pre, *dec) if p.polled_at > 0]
    count = Counter((u.stage, u.placed) for u in waiting)
    enc_seen = [p.queued + p.sent_since_poll for p in enc]
    enc_q = [q + share(count["encode", False], len(enc)) for q in enc_seen]
    pre_q = [p.queued + p.sent_since_poll for p in pre]
    # sent with media and no longer in encode's count: past encode, so in prefill (or in its batch)
    at_prefill = max(0, count["encode", True] - sum(enc_seen)) + count["prefill", True]
    pre_more = share(max(0, at_prefill - sum(pre_q)), len(pre)) + share(count["prefill", False], len(pre))
    overdue = sum(u.overdue(now) for u in waiting) - sum(p.overdue for p in enc)
    pre_over = share(max(0, overdue - sum(p.overdue for p in pre)), len(pre))
    return LiveState(
        min(polled) if polled else now,
        tuple(EncodeState(q, encode_batch, 0.0, p.recent_batch_s, p.recent_batch_size, min(p.overdue, q))
              for p, q in zip(enc, enc_q)),
        tuple(PrefillState(q + pre_more, prefill_tokens, p.recent_batch_s, p.recent_batch_size,
                           min(q + pre_more, p.overdue + pre_over))
              for p, q in zip(pre, pre_q)),
        # decode: the reservations made since the poll will run (its own `queued` is what waits)
        tuple(DecodeState(max(0, p.reported - p.queued) + p.sent_since_poll, p.queued, p.kv_free_tokens,
                          p.recent_batch_s, p.recent_batch_size)
              for p in dec))
