"""The latency predictor (easerve/policy/latency.py) and SLO-aware admission (easerve/policy/admission.py)
over the simulator's own service times (`ServiceModel` of a hand-made profile)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easerve.fields import FieldError
from easerve.policy.admission import Admission, TierLimits
from easerve.policy.clock import ManualClock
from easerve.policy.latency import (DecodeState, EncodeState, LatencyPredictor, LiveState, PrefillState,
                                    RequestShape)
from easerve.policy.service_model import ServiceModel
from tests.support.profiles import make_profile

SVC = ServiceModel(make_profile(encode_s_per_item=0.1, prefill_tok_s=1000.0, decode_tok_s=2000.0))
IMAGE = RequestShape("image", "224x224", prompt_tokens=64, max_tokens=16)
TEXT = RequestShape("text", "", prompt_tokens=64, max_tokens=16)
counts = st.integers(0, 64)


def state(enc_q=0, pre_q=0, running=0, waiting=0, kv_free=1 << 20, at=0.0, B=4, budget=256) -> LiveState:
    return LiveState(at, (EncodeState(enc_q, B),), (PrefillState(pre_q, budget),),
                     (DecodeState(running, waiting, kv_free),))


def predictor(now: float = 0.0) -> LatencyPredictor:
    return LatencyPredictor(SVC, ManualClock(now))


def test_an_idle_deployment_predicts_the_unloaded_path_from_the_profile():
    p = predictor().predict(IMAGE, state())
    assert p.queue_s == 0 and p.decode_wait_s == 0
    assert p.encode_s == pytest.approx(0.1)                      # encode_latency(1) of the profile
    assert p.prefill_s == pytest.approx(64 / 1000.0)              # prefill_latency(64, 1)
    assert p.ttft_s == pytest.approx(0.1 + 0.064)
    assert p.tpot_s == pytest.approx(SVC.decode_step_s(1, 64 + 8))


def test_a_queue_waits_for_the_full_batches_ahead_and_half_the_running_one():
    # 9 queued, B = 4: two full batches ahead (0.4 s each), half of a running batch of 4, own batch of 2
    p = predictor().predict(IMAGE, state(enc_q=9))
    assert p.queue_s == pytest.approx(2 * 0.4 + 0.5 * 0.4)
    assert p.encode_s == pytest.approx(0.2)


def test_text_only_requests_skip_encode_but_wait_for_prefill():
    p = predictor().predict(TEXT, state(enc_q=40, pre_q=0))
    assert p.encode_s == 0 and p.queue_s == 0
    assert predictor().predict(TEXT, state(pre_q=20)).queue_s > 0


@settings(max_examples=200, deadline=None)
@given(counts, counts, counts, counts, st.sampled_from([IMAGE, TEXT]))
def test_ttft_is_monotone_in_the_queues_and_tpot_in_decode_load(enc_q, pre_q, running, waiting, req):
    pr = predictor()
    base = pr.predict(req, state(enc_q, pre_q, running, waiting))
    assert pr.predict(req, state(enc_q + 1, pre_q, running, waiting)).ttft_s >= base.ttft_s
    assert pr.predict(req, state(enc_q, pre_q + 1, running, waiting)).ttft_s >= base.ttft_s
    if waiting == 0:  # with a queue at decode, more running requests also free room sooner
        assert pr.predict(req, state(enc_q, pre_q, running + 1, waiting)).tpot_s >= base.tpot_s
    assert pr.predict(req, state(enc_q, pre_q, running, waiting + 1)).tpot_s >= base.tpot_s
    assert pr.predict(req, state(enc_q, pre_q, running, waiting, kv_free=0)).tpot_s >= base.tpot_s


@settings(max_examples=100, deadline=None)
@given(counts, counts, st.floats(0, 10))
def test_an_older_snapshot_predicts_no_more_queueing_never_less_than_unloaded(enc_q, pre_q, age):
    fresh = predictor(0.0).predict(IMAGE, state(enc_q, pre_q))
    aged = predictor(age).predict(IMAGE, state(enc_q, pre_q))
    idle = predictor().predict(IMAGE, state())
    assert aged.ttft_s <= fresh.ttft_s
    assert aged.queue_s == pytest.approx(max(0.0, fresh.queue_s - age))
    assert aged.ttft_s >= idle.ttft_s - 1e-12  # its own batch is never smaller than one


@settings(max_examples=100, deadline=None)
@given(counts, counts)
def test_the_least_loaded_instance_is_the_prediction(q1, q2):
    two = LiveState(0.0, (EncodeState(q1, 4), EncodeState(q2, 4)), (PrefillState(0, 256),))
    one = LiveState(0.0, (EncodeState(min(q1, q2), 4),), (PrefillState(0, 256),))
    assert predictor().predict(IMAGE, two).ttft_s == pytest.approx(predictor().predict(IMAGE, one).ttft_s)


def test_states_are_checked_and_name_the_field():
    with pytest.raises(FieldError, match="max_batch"):
        EncodeState(0, 0)
    with pytest.raises(FieldError, match="prompt_tokens"):
        RequestShape("text", "", 0, 4)


# ---- admission ---------------------------------------------------------------------------------------
TIGHT = TierLimits(ttft_s=0.5, tpot_s=0.05, name="tight")


def admission(mode: str, now: float = 0.0) -> Admission:
    clock = ManualClock(now)
    return Admission(mode, LatencyPredictor(SVC, clock), clock)


def test_a_request_that_can_meet_its_tier_is_admitted_in_every_mode():
    for mode in ("off", "reject", "best-effort"):
        d = admission(mode).decide(IMAGE, state(), TIGHT, "interactive", received=0.0)
        assert d.action == "admit" and not d.predicted_miss and d.deadline == 0.5


def test_a_predicted_miss_is_refused_admitted_best_effort_or_only_noted_as_configured():
    busy = state(enc_q=20)  # 5 full batches of 0.4 s ahead: far past 0.5 s
    assert admission("reject").decide(IMAGE, busy, TIGHT, "interactive", 0.0).action == "reject"
    assert admission("best-effort").decide(IMAGE, busy, TIGHT, "batch", 0.0).action == "best_effort"
    off = admission("off").decide(IMAGE, busy, TIGHT, "interactive", 0.0)
    assert off.action == "admit" and off.predicted_miss


def test_time_already_spent_counts_against_the_tier():
    a = admission("reject", now=0.4)   # received at 0, 0.4 s spent in the gateway before the decision
    assert a.decide(IMAGE, state(at=0.4), TIGHT, "interactive", received=0.0).action == "reject"
    assert a.decide(IMAGE, state(at=0.4), TIGHT, "interactive", received=0.4).action == "admit"


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 64), st.integers(0, 16))
def test_retrying_after_the_retry_after_is_predicted_to_meet_the_tier(enc_q, pre_q):
    """A refusal caused by queueing: once the snapshot aged by Retry-After, the same request
    sent again is admitted."""
    busy = state(enc_q, pre_q)
    d = admission("reject").decide(IMAGE, busy, TIGHT, "interactive", 0.0)
    p = d.prediction
    if d.action != "reject" or p.tpot_s > TIGHT.tpot_s or p.ttft_s - p.queue_s > TIGHT.ttft_s:
        return  # not a queueing miss: no wait helps
    assert d.retry_after_s > 0
    later = d.retry_after_s + 1e-9
    again = admission("reject", now=later).decide(IMAGE, busy, TIGHT, "interactive", received=later)
    assert again.action == "admit"
    sooner = d.retry_after_s * 0.9
    if d.retry_after_s > 1e-3:
        assert admission("reject", now=sooner).decide(IMAGE, busy, TIGHT, "interactive", sooner).action == "reject"


def test_an_unknown_mode_names_the_flag():
    with pytest.raises(ValueError, match="--admission"):
        admission("sometimes")


def test_an_instance_running_slower_than_the_profile_scales_its_times_by_its_recent_pace():
    # encode batches of 4 have lately taken 1.2 s where the profile says 0.4 s: 3x, on waits and service
    slow = LiveState(0.0, (EncodeState(9, 4, 0.0, recent_batch_s=1.2, recent_batch_size=4),), (PrefillState(0, 256),))
    p, base = predictor().predict(IMAGE, slow), predictor().predict(IMAGE, state(enc_q=9))
    assert p.queue_s == pytest.approx(3 * base.queue_s)
    assert p.encode_s == pytest.approx(3 * base.encode_s)
    # decode steps of 8 sequences at 2x the profile's step time: TPOT doubles
    dec = LiveState(0.0, (), (), (DecodeState(3, 0, 1 << 20, 2 * SVC.decode_step_s(8, 64 + 8), 8),))
    assert predictor().predict(IMAGE, dec).tpot_s == pytest.approx(2 * predictor().predict(IMAGE, state(running=3)).tpot_s)
    # prefill: 128 tokens a batch at 4x; an unknown pace (0) is the profile's own
    pre = LiveState(0.0, (), (PrefillState(3, 256, 4 * SVC.prefill_s(128, 2), 128),))
    assert predictor().predict(TEXT, pre).prefill_s == pytest.approx(4 * predictor().predict(TEXT, state(pre_q=3)).prefill_s)
    assert predictor().predict(IMAGE, LiveState(0.0, (EncodeState(9, 4, 0.0, 0.0, 0.0),))).queue_s == \
        pytest.approx(base.queue_s)


def test_the_pace_scale_is_bounded_and_never_faster_than_the_profile():
    wild = LiveState(0.0, (EncodeState(0, 4, 0.0, recent_batch_s=1e6, recent_batch_size=1),))
    assert predictor().predict(IMAGE, wild).encode_s == pytest.approx(16 * 0.1)
    quick = LiveState(0.0, (EncodeState(0, 4, 0.0, recent_batch_s=0.01, recent_batch_size=1),))  # cache hits
    assert predictor().predict(IMAGE, quick).encode_s == pytest.approx(0.1)


def test_pace_is_a_moving_average_of_batch_seconds_and_sizes_forgotten_when_stale():
    from easerve.policy.clock import ManualClock
    from easerve.stages.common.pace import Pace
    clock = ManualClock(0.0)
    p = Pace(alpha=0.5, ttl_s=5.0, clock=clock)
    assert p.now() == (0.0, 0.0)
    p.observe(1.0, 4)
    assert p.now() == (1.0, 4.0)                       # the first batch is taken whole
    clock.advance(1.0)
    p.observe(3.0, 8)
    assert p.now() == (2.0, 6.0)
    p.observe(5.0, 0)                                  # an empty batch says nothing
    assert p.now() == (2.0, 6.0)
    clock.advance(5.5)                                 # idle past the ttl: unknown, not stale-slow
    assert p.now() == (0.0, 0.0)
    p.observe(0.5, 2)                                  # and the next batch starts afresh
    assert p.now() == (0.5, 2.0)
    with pytest.raises(ValueError, match="alpha"):
        Pace(alpha=0.0)


def test_n_choices_decode_together_and_need_the_kv_of_each():
    four = dataclasses.replace(IMAGE, n=4)
    p1, p4 = predictor().predict(IMAGE, state(running=3)), predictor().predict(four, state(running=3))
    assert p1.tpot_s == pytest.approx(SVC.decode_step_s(4, 64 + 8))     # 3 running + 1
    assert p4.tpot_s == pytest.approx(SVC.decode_step_s(7, 64 + 8))     # 3 running + 4 choices
    room = 64 + 16 * 2                                                  # the prompt once and two choices' tokens
    assert predictor().predict(dataclasses.replace(IMAGE, n=2), state(running=3, kv_free=room)).decode_wait_s == 0
    assert predictor().predict(dataclasses.replace(IMAGE, n=3), state(running=3, kv_free=room)).decode_wait_s > 0
    assert p4.ttft_s == pytest.approx(p1.ttft_s)                        # one prefill for every choice


# ---- the queues' deadline order ------------------------------------------------------------------
def test_a_request_that_can_meet_its_tier_waits_only_behind_the_queued_ones_not_overdue():
    # 9 queued, 8 of them overdue (past their deadline or yielding), B = 4: one on-time item ahead
    s = LiveState(0.0, (EncodeState(9, 4, overdue=8),), (PrefillState(0, 256),))
    on_time = predictor().predict(IMAGE, s, due_s=10.0)
    assert not on_time.demoted
    assert on_time.queue_s == pytest.approx(0.5 * 0.4)            # half the running batch, no full one
    assert on_time.encode_s == pytest.approx(0.2)                 # its own batch: the one ahead and itself
    fifo = predictor().predict(IMAGE, s)                          # no deadline: no order assumed
    assert fifo.queue_s == pytest.approx(2 * 0.4 + 0.5 * 0.4) and not fifo.demoted


def test_a_request_that_yields_or_will_be_overdue_is_predicted_behind_the_whole_queue():
    s = LiveState(0.0, (EncodeState(9, 4, overdue=8),), (PrefillState(10, 256, overdue=10),))
    whole = predictor().predict(IMAGE, s).queue_s
    yielding = predictor().predict(IMAGE, s, due_s=10.0, yields=True)
    assert yielding.demoted and yielding.queue_s == pytest.approx(whole)
    # on time it would leave its queues at 0.2 + 0.128 (half prefill's running batch) + 0.2 s of encode:
    # a 0.5 s deadline passes first, a 0.55 s one does not
    late = predictor().predict(IMAGE, s, due_s=0.5)
    assert late.demoted and late.queue_s == pytest.approx(whole)
    assert not predictor().predict(IMAGE, s, due_s=0.55).demoted


def test_a_demoted_prediction_is_a_lower_bound_that_calibrates_only_when_the_request_came_in_under_it():
    from easerve.policy.calibration import Calibration
    clock = ManualClock(0.0)
    pr = LatencyPredictor(SVC, clock, Calibration(clock))
    s = LiveState(0.0, (EncodeState(9, 4, overdue=8),), (PrefillState(0, 256),))
    demoted = pr.predict(IMAGE, s, due_s=10.0, yields=True)
    pr.observe_ttft(demoted, 10 * demoted.ttft_s)      # overtaken by later arrivals: nothing learned
    assert pr.calibration.ttft_factor() == 1.0
    pr.observe_ttft(demoted, 0.5 * demoted.ttft_s)     # under a lower bound: the model over-predicts
    assert pr.calibration.ttft_factor() == pytest.approx(0.5)
    clock.advance(3600.0)                              # relaxed back to the lasting bias: none, as it
    assert pr.calibration.ttft_factor() == pytest.approx(1.0)  # was predicted to queue
    on_time = pr.predict(IMAGE, s, due_s=10.0)           # a prediction that is not a bound calibrates
    pr.observe_ttft(on_time, 2 * on_time.ttft_s)          # both ways (the fast average's second sample)
    assert pr.calibration.ttft_factor() == pytest.approx(2 ** 0.3)


def test_overdue_is_part_of_queued():
    with pytest.raises(ValueError, match="overdue <= queued"):
        EncodeState(2, 4, overdue=3)
    with pytest.raises(ValueError, match="overdue <= queued"):
        PrefillState(0, 256, overdue=1)


def test_admission_predicts_with_the_tier_deadline_and_a_batch_request_yields():
    s = LiveState(0.0, (EncodeState(9, 4, overdue=8),), (PrefillState(0, 256),))
    loose = TierLimits(ttft_s=5.0, tpot_s=0.05, name="loose")
    assert admission("reject").decide(IMAGE, s, loose, "interactive", 0.0).prediction.queue_s == pytest.approx(0.2)
    batch = admission("reject").decide(IMAGE, s, loose, "batch", 0.0).prediction
    assert batch.demoted and batch.queue_s == pytest.approx(1.0)
