"""Latency predictor: an arriving request's TTFT and TPOT from the profile and the live state.

Pure and torch-free, with an injected clock. The service times come from one source, a
`ServiceTimes` (in practice `easerve.policy.service_model.ServiceModel` over an `easerve.profile/v1`
file: the very numbers the simulator runs on, including `encode_batch_s`, the time of a
mixed encode batch). The live state is a frozen `LiveState` snapshot of what a caller sees of
the stages (the gateway: each instance's last `Stage/Load` answer plus what it sent since).

The model, per stage (each instance's prediction is taken, then the least of them, which is
where least-loaded placement sends the request):
- gateway: `gateway_s(modality, media)` of preprocessing;
- encode (media only): the batcher's queue leaves in batches of `max_batch`; the request
  waits for the batches ahead of it (`queued // max_batch` full ones), half a batch for the
  one running when the queue is not empty, and the batcher's expected dispatch wait; then
  its own batch (`queued % max_batch + 1` items) runs;
- prefill (remote, or the text-only path): the same over a token budget (`budget //
  prompt_tokens` requests a batch), with the request's own prompt length for every one;
- decode: TPOT is a step of `running + n` sequences (the request's n choices decode together)
  at the request's mean context; when decode has waiting requests or less free KV than the
  request needs (its prompt once plus n x max_tokens), the request waits for
  `waiting + 1` requests to finish, each `step * max_tokens / (2 * running)` on average, and
  that wait is spread over its tokens.
With a `Calibration`, both predictions are then scaled by its factors (what recent requests
got over what was predicted for them; a request predicted to wait in no queue takes the lesser
of the fast and the lasting one while admission refuses little, easerve/policy/calibration.py).
The queue waits shrink by the age of the snapshot (they drain while the state ages), never
below zero.

Deadline order (easerve/policy/slo_order.py): the encode batcher and the prefill planner serve
the requests that can still meet their tier first; a request that yields (best-effort, `batch`)
or whose deadline has passed goes behind every such one. A state's `overdue` counts the
queued requests put last. With `due_s` (the request's TTFT limit from its arrival) the
request is first predicted behind only the others (`queued - overdue`); if it is predicted to
leave its last queue (spent + gateway + waits + encode) after `due_s`, it will itself be
overdue by then, and it is predicted again behind the whole queue (`demoted`). A request that
`yields` is predicted behind the whole queue at once. Either way that is a lower bound: the
requests that arrive after it and can still meet their tier go ahead of it too, which nothing
seen at its arrival tells, so a demoted prediction calibrates only when the request came in
under it (the model over-predicted; above it, it says nothing). Without `due_s` the request
waits behind the whole queue (no deadline order assumed).

Elapsed time: a caller that predicts after the gateway's preprocessing (the gateway's admission
does) passes `elapsed_s`, the time the request has already spent since it arrived (its wait for a
preprocessing thread and the preprocessing itself). That part is known, not predicted: the TTFT
is then `elapsed_s` plus the calibrated rest (queues, encode, prefill), and `gateway_s` is not
counted again. Without it (None) the request is predicted from its arrival, `gateway_s` included.

Pace: the profile times a stage alone; a live instance can run slower (neighbours on the
same cores or GPU, fewer threads). When a state carries the instance's recent pace (its
moving-average batch seconds and size, from `Stage/Load`), that instance's times are the
profile's times scaled by recent seconds / the profile's seconds for a batch of the recent
size, within [1, 16]: the profile is the idle best case, and a batch that ran faster (cache
hits, a smaller media size) says nothing about the next. Without a pace the scale is 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from easerve.fields import Checked, NonNegFloat, NonNegInt, PosInt
from easerve.policy.calibration import Calibration, waits_in_no_queue
from easerve.policy.clock import Clock


class ServiceTimes(Protocol):
    def gateway_s(self, modality: str, media: str) -> float: ...
    def encode_batch_s(self, mix: dict[tuple[str, str], int], share: float = 1.0) -> float: ...
    def prefill_s(self, total_tokens: int, batch: int) -> float: ...
    def decode_step_s(self, batch: int, context: int) -> float: ...


@dataclass(frozen=True)
class EncodeState(Checked):
    """One encode instance: `queued` requests in its batcher (plus those sent since the
    look), batches of up to `max_batch`; `dispatch_wait_s`: how long the batcher is expected
    to hold an arrival before dispatching (0 when the caller cannot see its clock)."""
    queued: NonNegInt
    max_batch: PosInt
    dispatch_wait_s: NonNegFloat = 0.0
    recent_batch_s: NonNegFloat = 0.0      # pace: requests per batch, and its seconds
    recent_batch_size: NonNegFloat = 0.0
    overdue: NonNegInt = 0                 # of `queued`, put last by the deadline order

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_overdue(self)


@dataclass(frozen=True)
class PrefillState(Checked):
    """One prefill instance: `queued` requests waiting, batched under `token_budget` tokens."""
    queued: NonNegInt
    token_budget: PosInt
    recent_batch_s: NonNegFloat = 0.0      # pace: prompt tokens per batch, and its seconds
    recent_batch_size: NonNegFloat = 0.0
    overdue: NonNegInt = 0                 # of `queued`, put last by the deadline order

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_overdue(self)


def _check_overdue(s) -> None:
    if s.overdue > s.queued:
        raise ValueError(f"{type(s).__name__}: overdue ({s.overdue}) is part of queued ({s.queued}); "
                         "pass overdue <= queued")


@dataclass(frozen=True)
class DecodeState(Checked):
    """One decode instance: requests decoding, requests waiting for room, KV room in tokens."""
    running: NonNegInt
    waiting: NonNegInt
    kv_free_tokens: NonNegInt
    recent_batch_s: NonNegFloat = 0.0      # pace: sequences per step, and its seconds
    recent_batch_size: NonNegFloat = 0.0


@dataclass(frozen=True)
class LiveState:
    """What the caller saw at `taken_at` (its clock's time). An empty tuple: the stage has
    no instance the caller sees; the request is predicted as if it had an idle one."""
    taken_at: float
    encode: tuple[EncodeState, ...] = ()
    prefill: tuple[PrefillState, ...] = ()
    decode: tuple[DecodeState, ...] = ()


@dataclass(frozen=True)
class RequestShape(Checked):
    modality: str          # image, video, audio or text
    media: str             # its media size as the profile names it ("" for text, or unknown)
    prompt_tokens: PosInt
    max_tokens: PosInt
    n: PosInt = 1          # choices: n sequences decode together, sharing the prompt's KV

    @property
    def has_media(self) -> bool:
        return self.modality != "text"


@dataclass(frozen=True)
class Prediction:
    """Seconds, from the request's arrival. `ttft_s` = elapsed_s + factor x (gateway_s + queue_s +
    encode_s + prefill_s), where `gateway_s` is 0 when `elapsed_s` was given (preprocessing is
    over); `tpot_s` includes the decode wait spread over the tokens after the first."""
    ttft_s: float
    tpot_s: float
    gateway_s: float
    queue_s: float         # encode and prefill waits, aged
    encode_s: float
    prefill_s: float
    decode_wait_s: float
    ttft_factor: float = 1.0   # the calibration's factors, already applied to ttft_s / tpot_s
    tpot_factor: float = 1.0
    elapsed_s: float = 0.0     # spent before the prediction was made (known, not scaled)
    demoted: bool = False      # predicted behind the whole queue (it yields, or will be overdue): a lower bound
    ttft_margin: float = 1.0   # a miss is a TTFT over its limit x this (the calibration's scatter)
    tpot_margin: float = 1.0

    @property
    def raw_ttft_s(self) -> float:
        """The uncalibrated TTFT from arrival."""
        return self.elapsed_s + self.remaining_raw_s

    @property
    def remaining_raw_s(self) -> float:
        """The uncalibrated part still to come: what the calibration compares with."""
        return (self.ttft_s - self.elapsed_s) / self.ttft_factor

    @property
    def raw_tpot_s(self) -> float:
        return self.tpot_s / self.tpot_factor


class LatencyPredictor:
    def __init__(self, service: ServiceTimes, clock: Clock, calibration: Calibration | None = None) -> None:
        """`calibration`: scales every prediction by what past requests actually got
        (easerve/policy/calibration.py); None: the raw model."""
        self.service, self.clock, self.calibration = service, clock, calibration

    def predict(self, req: RequestShape, state: LiveState, elapsed_s: float | None = None,
                due_s: float | None = None, yields: bool = False) -> Prediction:
        """`elapsed_s`: seconds since the request arrived, when the gateway's preprocessing is
        already over; `due_s`: its TTFT limit from arrival (the queues' deadline order);
        `yields`: it goes behind every request that can still meet its tier (see the module
        docstring for each)."""
        age = max(0.0, self.clock.now() - state.taken_at)
        g = self.service.gateway_s(req.modality, req.media) if elapsed_s is None else 0.0
        spent = 0.0 if elapsed_s is None else max(0.0, elapsed_s)
        behind_all = yields or due_s is None  # without a deadline no order is assumed
        queue, enc, pre = self._waits(req, state, age, behind_all)
        kt = self._ttft_factor(queue, g + queue + enc + pre)
        if not behind_all and spent + kt * (g + queue + enc) > due_s:  # overdue before it leaves its queues
            behind_all = True
            queue, enc, pre = self._waits(req, state, age, behind_all)
            kt = self._ttft_factor(queue, g + queue + enc + pre)
        step, dwait = min((self._decode(req, d) for d in state.decode or (DecodeState(0, 0, 1 << 62),)),
                          key=lambda x: x[0] + x[1] / max(1, req.max_tokens - 1))
        tpot = step + dwait / max(1, req.max_tokens - 1)
        cal = self.calibration
        kp = cal.tpot_factor(uncongested=dwait == 0.0) if cal else 1.0
        return Prediction(spent + kt * (g + queue + enc + pre), kp * tpot, g, queue, enc, pre, dwait, kt, kp, spent,
                          demoted=behind_all and due_s is not None,
                          ttft_margin=cal.ttft_margin() if cal else 1.0, tpot_margin=cal.tpot_margin() if cal else 1.0)

    def _ttft_factor(self, queue_s: float, raw_s: float) -> float:
        """The calibration's TTFT factor for a raw prediction of `raw_s` with `queue_s` of waits
        (the lesser one when it waits in no queue: easerve/policy/calibration.py)."""
        if self.calibration is None:
            return 1.0
        return self.calibration.ttft_factor(uncongested=waits_in_no_queue(queue_s, raw_s))

    def observe_ttft(self, pred: Prediction, actual_s: float, probe: bool = False) -> None:
        """A request's first token came `actual_s` after it arrived: the calibration learns from
        the part that was predicted (what was already spent at the prediction is left out); from
        a demoted prediction (a lower bound, see the module docstring) only when it came in under it.
        `probe`: admission's probe (easerve/policy/admission.py), taken as the present truth."""
        if self.calibration is not None and not (pred.demoted and actual_s >= pred.ttft_s):
            self.calibration.observe_ttft(pred.remaining_raw_s, actual_s - pred.elapsed_s, pred.queue_s, probe)

    def admitted(self) -> None:
        """A request was let in: the calibration counts it (its refused share)."""
        if self.calibration is not None:
            self.calibration.admitted()

    def refused(self, pred: Prediction, ttft_limit_s: float) -> None:
        """`pred`'s request was refused: the calibration notes it, and when its raw TTFT met
        `ttft_limit_s` (the correction alone refused it) scores it against its shadow estimate."""
        if self.calibration is not None:
            self.calibration.refused(by_correction=pred.raw_ttft_s <= ttft_limit_s < pred.ttft_s)

    def observe_tpot(self, pred: Prediction, actual_s: float, probe: bool = False) -> None:
        if self.calibration is not None:
            self.calibration.observe_tpot(pred.raw_tpot_s, actual_s, pred.decode_wait_s == 0.0, probe)

    def _waits(self, req: RequestShape, state: LiveState, age: float, behind_all: bool) -> tuple[float, float, float]:
        """(encode + prefill wait aged by `age`, encode time, prefill time) on the best instances."""
        enc_wait = enc = 0.0
        if req.has_media:
            enc_wait, enc = min((self._encode(req, e, behind_all) for e in state.encode or (EncodeState(0, 1),)),
                                key=sum)
        pre_wait, pre = min((self._prefill(req, p, behind_all)
                             for p in state.prefill or (PrefillState(0, req.prompt_tokens),)), key=sum)
        return max(0.0, enc_wait + pre_wait - age), enc, pre

    # ---- per stage: (wait, own service time) -------------------------------------------------
    def _encode(self, req: RequestShape, e: EncodeState, behind_all: bool) -> tuple[float, float]:
        key = (req.modality, req.media)
        pace = _pace(e.recent_batch_s, e.recent_batch_size,
                     lambda n: self.service.encode_batch_s({key: n}))
        queued = e.queued if behind_all else e.queued - e.overdue
        full, left = divmod(queued, e.max_batch)
        batch_s = self.service.encode_batch_s({key: e.max_batch})
        running = 0.5 * self.service.encode_batch_s({key: min(e.queued, e.max_batch)}) if e.queued else 0.0
        return pace * (full * batch_s + running) + e.dispatch_wait_s, pace * self.service.encode_batch_s({key: left + 1})

    def _prefill(self, req: RequestShape, p: PrefillState, behind_all: bool) -> tuple[float, float]:
        per = max(1, p.token_budget // req.prompt_tokens)  # requests a batch holds
        pace = _pace(p.recent_batch_s, p.recent_batch_size,
                     lambda n: self.service.prefill_s(n, max(1, round(n / req.prompt_tokens))))
        full, left = divmod(p.queued if behind_all else p.queued - p.overdue, per)
        batch_s = self.service.prefill_s(per * req.prompt_tokens, per)
        running = 0.5 * self.service.prefill_s(min(p.queued, per) * req.prompt_tokens, min(p.queued, per)) \
            if p.queued else 0.0
        return pace * (full * batch_s + running), pace * self.service.prefill_s((left + 1) * req.prompt_tokens, left + 1)

    def _decode(self, req: RequestShape, d: DecodeState) -> tuple[float, float]:
        context = req.prompt_tokens + req.max_tokens // 2
        pace = _pace(d.recent_batch_s, d.recent_batch_size, lambda n: self.service.decode_step_s(n, context))
        step = pace * self.service.decode_step_s(d.running + req.n, context)
        need = req.prompt_tokens + req.n * req.max_tokens
        ahead = d.waiting + (1 if d.kv_free_tokens < need else 0)
        wait = ahead * step * req.max_tokens / (2 * max(1, d.running)) if ahead else 0.0
        return step, wait


PACE_BOUNDS = (1.0, 16.0)


def _pace(recent_s: float, recent_size: float, profile_s) -> float:
    """Recent seconds over the profile's seconds for a batch of the recent size (1 unknown)."""
    if recent_s <= 0.0 or recent_size <= 0.0:
        return 1.0
    expected = profile_s(max(1, round(recent_size)))
    if expected <= 0.0:
        return 1.0
    return min(PACE_BOUNDS[1], max(PACE_BOUNDS[0], recent_s / expected))


def retry_after_s(pred: Prediction, ttft_limit_s: float, tpot_limit_s: float, max_tokens: int) -> float:
    """How long until a request of this shape would be predicted to meet the limits: the
    queues must drain by the excess TTFT (the prediction's, from arrival), and decode by the
    excess TPOT over the request's tokens (at least a millisecond)."""
    over_ttft = pred.ttft_s - ttft_limit_s
    over_tpot = (pred.tpot_s - tpot_limit_s) * max(1, max_tokens - 1)
    return max(1e-3, over_ttft, over_tpot)
