"""What the gateway's admission sees of the stages (easerve/stages/gateway/admission.py): each
instance's last Load answer (its queue, and how much of it the deadline order puts last), the
calls started there since, and the requests admitted that have not reached their first stage
yet. A burst is admitted while its first requests still wait for decode's reservation; without
that last count each of the burst would be predicted against empty queues."""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from easerve.stages.common.configs import GatewayConfig
from easerve.stages.gateway.admission import GatewayAdmission
from easerve.stages.gateway.job import Job
from easerve.stages.gateway.metrics import GatewayMetrics
from easerve.types import SamplingParams
from easerve import profile_format as pf
from tests.support.profiles import make_profile


class Instances:
    """A stage's instances as the gateway's Peers shows them: each with its last Load answer."""
    def __init__(self, *loads: dict):
        base = dict(queued=0, sent_since_poll=0, overdue=0, polled_at=1.0, reported=0, kv_free_tokens=1 << 20,
                    recent_batch_s=0.0, recent_batch_size=0.0)
        self.peers = [SimpleNamespace(**{**base, **ld}) for ld in loads]

    def up_peers(self):
        return self.peers


@pytest.fixture
def gateway(tmp_path):
    unloaded = (pf.Unloaded("image", "224x224", 64, 8, 1.0, 0.1), pf.Unloaded("text", "", 32, 8, 1.0, 0.1))
    prof = dataclasses.replace(make_profile(encode_s_per_item=0.1), unloaded=unloaded, tiers=pf.tiers_from(unloaded))
    cfg = GatewayConfig(model=str(tmp_path), admission="off", profile=str(pf.dump(prof, tmp_path / "p.json")),
                        admission_encode_batch=4, prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",))
    enc = Instances({"queued": 3, "overdue": 2}, {"queued": 1, "sent_since_poll": 2})
    pre, dec = Instances({"queued": 5, "overdue": 5}), Instances({})
    return GatewayAdmission.of(cfg, enc, pre, dec, GatewayMetrics())


def job(k: int) -> Job:
    return Job(SamplingParams(max_tokens=8), f"req-{k}")


def test_the_state_counts_each_instances_queue_its_overdue_part_and_the_calls_sent_since(gateway):
    s = gateway.state()
    assert [(e.queued, e.overdue) for e in s.encode] == [(3, 2), (3, 0)]
    assert [(p.queued, p.overdue) for p in s.prefill] == [(5, 5)]


def test_admitted_requests_count_in_their_first_stage_until_placed(gateway):
    media = [job(k) for k in range(3)]
    for j in media:                      # a burst: admitted one after another, none sent yet
        gateway.admit(j, "image", 64)
    text = job(9)
    gateway.admit(text, "text", 32)
    s = gateway.state()
    assert [e.queued for e in s.encode] == [3 + 2, 3 + 2]   # 3 heading for 2 instances: 2 more each
    assert [p.queued for p in s.prefill] == [5 + 1]
    for j in (*media, text):
        gateway.placed(j)                # now the stage's own counts (sent since the poll) have them
    s = gateway.state()
    assert [e.queued for e in s.encode] == [3, 3] and [p.queued for p in s.prefill] == [5]



def test_sent_requests_no_longer_in_encodes_count_are_at_prefill(gateway):
    jobs = [job(k) for k in range(10)]
    for j in jobs:
        gateway.admit(j, "image", 64)
        gateway.placed(j)
    # encode's counts (3 + 3 on two instances) hold 6 of the 10 at most: 4 are past encode; prefill's
    # last answer (5 queued) already says more
    assert [p.queued for p in gateway.state().prefill] == [5]
    for p in gateway._enc.peers:         # a poll: encode has drained, so all 10 are at prefill
        p.queued = p.sent_since_poll = 0
    assert [p.queued for p in gateway.state().prefill] == [10]
    for j in jobs[:4]:                   # 4 got their first token
        gateway.ended(j)
    assert [p.queued for p in gateway.state().prefill] == [6]


def test_requests_past_their_deadline_count_as_overdue_beyond_encodes_own(gateway):
    gateway._pre.peers[0].overdue = 0
    late = [Job(SamplingParams(max_tokens=8), f"late-{k}", received=time.monotonic() - 100.0) for k in range(3)]
    for j in late:                       # admitted (admission off) long past their deadline
        gateway.admit(j, "image", 64)
        gateway.placed(j)
    s = gateway.state()
    assert [e.overdue for e in s.encode] == [2, 0]          # encode's own answer
    assert [p.overdue for p in s.prefill] == [3 - 2]        # the gateway's 3, less encode's 2


def test_decode_reservations_since_the_poll_will_run_not_wait(gateway):
    d = gateway._dec.peers[0]
    d.reported, d.queued, d.sent_since_poll = 2, 1, 3
    dec = gateway.state().decode[0]
    assert (dec.running, dec.waiting) == (1 + 3, 1)
