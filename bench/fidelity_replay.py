"""Trace replay for the simulator's fidelity: service-time error apart from queueing error.

(a) service time: each live call span (an encode batch, a prefill batch, a decode step; the
    gateway's preprocessing per request) against the profile's prediction for that batch, times
    the slowdown of the neighbours whose spans overlap it on the same device or cores (as
    easerve/sim/compute.py `Compute.factor` reckons it, averaged over the span's time):
    |log(predicted / measured)| per span; per stage the median (`service_time_err_median`).
(b) queueing: the simulator replays the live arrivals and sizes with the *measured* call times
    (`MeasuredModel`), and its per-request TTFT is set against the live one (`replay_ttft_error`,
    `replay_ttft_p50_err` = |log(sim TTFT p50 / live TTFT p50)|: a log ratio, symmetric in over-
    and under-prediction, 0 when equal, log 2 ~ 0.69 when off by a factor of 2).

Where the spans come from (`collect_spans(stack.endpoints().metrics)`; `hasctl.launch.Stack(...,
metrics=True)` gives each stage process a --metrics-listen):
- encode-N, monolith-N: GET /trace?window_s=S -> {"now", "buckets", "spans": [{"kind": "encode" |
  "prefill", "start", "end", "share", "batch"}], "calls": [{"kind": "prefill", "start", "end",
  "batch", "tokens"}, {"kind": "decode", ..., "context"} (a monolith's)]};
- prefill-N: GET /trace -> {"now", "spans": [{"kind": "prefill", "start", "end", "batch", "tokens"}]};
- decode-N: GET /trace -> {"now", "spans": [{"kind": "decode", "start", "end", "batch", "context"}]};
- gateway: GET /trace?last=N -> {"requests": [{"request_id", "host_cpu_ms": {phase: ms}, ...}]}: the
  host CPU of parse + media + tokenize per request (a duration, no start or end: no neighbours).
Times are `time.monotonic()` seconds, one scale for all processes of a host.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from easerve.policy.service_model import ModelConfig, ServiceModel, shares_compute
from easerve.sim.workload import SimRequest
from hasctl.profile_gateway import PHASES as GATEWAY_PHASES  # the gateway's preprocessing (ServiceModel.gateway_s)

STAGES = ("gateway", "encode", "prefill", "decode")
Media = tuple[str, str]  # (modality, profile media label), e.g. ("image", "224x224")


@dataclass(frozen=True)
class Span:
    instance: str        # the process: "encode-0", "prefill-1", "monolith-0", "gateway"
    kind: str            # gateway | encode | prefill | decode
    start: float
    end: float
    batch: int = 1
    tokens: int = 0      # prefill: the batch's prompt tokens
    context: int = 0     # decode: the mean tokens a row attends to
    share: float = 1.0   # encode: the compute share it ran with

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Placement:
    device: str
    tp: int = 1


# ---- 1. the live spans ----------------------------------------------------------------------------
def spans_of(instance: str, doc: Mapping) -> list[Span]:
    """The call spans in one stage process's GET /trace answer (any of the shapes above)."""
    if "requests" in doc:  # the gateway's
        out = []
        for r in doc["requests"]:
            ms = r.get("host_cpu_ms") or {}
            d = sum(float(ms.get(p, 0.0)) for p in GATEWAY_PHASES) / 1e3
            out.append(Span(instance, "gateway", 0.0, d))
        return out
    calls = list(doc.get("calls") or ())
    called = {c["kind"] for c in calls}  # a co-located prefill's batch is in "calls" with its tokens
    raw = [s for s in doc.get("spans") or () if s["kind"] not in called] + calls
    return sorted((Span(instance, s["kind"], float(s["start"]), float(s["end"]), int(s.get("batch", 1)),
                        int(s.get("tokens", 0)), int(s.get("context", 0)), float(s.get("share", 1.0)))
                   for s in raw), key=lambda s: s.start)


def fetch_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the stack's own endpoints
        return json.loads(r.read())


SPANS_KEPT = 20000  # a stage's /trace keeps this many call spans (easerve/stages/common/call_spans.py)


def collect_spans(metrics: Mapping[str, str], window_s: float = 600.0, last: int = 500,
                  since: float | None = None, fetch: Callable[[str], dict] = fetch_json) -> dict[str, list[Span]]:
    """Every stage process's call spans, by process name: `metrics` is `Stack.endpoints().metrics`
    (name -> http://host:port); all a stage keeps of the last `window_s` seconds, the gateway's
    last `last` requests. `since`: keep the spans that start then or later (a cell's start,
    time.monotonic() on the stack's host); a process whose /trace does not answer gives none."""
    out: dict[str, list[Span]] = {}
    for name, base in metrics.items():
        url = (f"{base}/trace?last={last}" if name == "gateway"
               else f"{base}/trace?window_s={window_s}&last={SPANS_KEPT}")
        try:
            doc = fetch(url)
        except OSError:
            out[name] = []
            continue
        out[name] = [s for s in spans_of(name, doc) if since is None or s.kind == "gateway" or s.start >= since]
    return out


LATENCY_METRICS = {"easerve:stage_latency_seconds": None, "easerve:time_to_first_token_seconds": "ttft"}


def phase_totals(families: Iterable) -> dict[str, tuple[float, float]]:
    """From the gateway's metric families (bench/harness/stack.py metric_families): phase ->
    (seconds summed, requests) of its per-request phases (easerve:stage_latency_seconds by
    stage: preprocess, queue, encode, prefill, embed_transfer) and of "ttft"
    (easerve:time_to_first_token_seconds)."""
    out: dict[str, list[float]] = {}
    for fam in families:
        for smp in fam.samples:
            for name, fixed in LATENCY_METRICS.items():
                if smp.name in (name + "_sum", name + "_count"):
                    phase = fixed or smp.labels.get("stage", "")
                    out.setdefault(phase, [0.0, 0.0])[smp.name.endswith("_count")] += smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def phase_means_ms(before: Mapping[str, tuple[float, float]],
                   after: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Phase -> mean milliseconds per request over what the gateway counted between two
    `phase_totals` (a phase no request went through in between is left out)."""
    out = {}
    for phase, (s1, n1) in after.items():
        s0, n0 = before.get(phase, (0.0, 0.0))
        if n1 > n0:
            out[phase] = round((s1 - s0) / (n1 - n0) * 1e3, 2)
    return out


def placements(deployment) -> dict[str, Placement]:
    """Process name -> device and tp, from a hasctl Deployment (its stage lists of workers)."""
    return {f"{s}-{i}": Placement(w.device, getattr(w, "tp", 1))
            for s in ("encode", "prefill", "decode", "monolith") for i, w in enumerate(getattr(deployment, s, ()))}


# ---- 2. service-time error ------------------------------------------------------------------------
def predicted_s(span: Span, model: ServiceModel, tp: int = 1, media: Media = ("image", "224x224"),
                gateway_media: Media | None = None) -> float:
    """The profile's time for this call alone (no neighbours): encode of `batch` items of `media`
    (the spans do not say which media a batch held) at its share; prefill of its tokens and batch;
    a decode step of its batch and context; the gateway's preprocessing of `gateway_media`."""
    if span.kind == "encode":
        return model.encode_s(span.batch, span.share, *media, tp)
    if span.kind == "prefill":
        return model.prefill_s(max(1, span.tokens), span.batch, tp)
    if span.kind == "decode":
        return model.decode_step_s(span.batch, max(1, span.context), tp)
    if span.kind == "gateway":
        return model.gateway_s(*(gateway_media or media))
    raise ValueError(f"no prediction for a {span.kind!r} span")


class _Worker:
    def __init__(self, instance: str, kind: str, place: Placement, spans: list[Span]) -> None:
        self.instance, self.kind, self.place = instance, kind, place
        self.spans = sorted(spans, key=lambda s: s.start)
        self.starts = [s.start for s in self.spans]
        self.ends = [s.end for s in self.spans]  # sorted too: one worker's calls do not overlap
        self.neighbours: list[_Worker] = []

    @property
    def cpu(self) -> bool:
        return not self.place.device.startswith("cuda")

    def overlapping(self, a: float, b: float) -> list[Span]:
        return self.spans[bisect.bisect_right(self.ends, a):bisect.bisect_left(self.starts, b)]


def _workers(spans: Mapping[str, Sequence[Span]], where: Mapping[str, Placement]) -> list[_Worker]:
    ws = []
    for inst, ss in spans.items():
        by_kind: dict[str, list[Span]] = {}
        for s in ss:
            if s.kind != "gateway":
                by_kind.setdefault(s.kind, []).append(s)
        place = where.get(inst, Placement("cpu"))
        ws += [_Worker(inst, k, place, v) for k, v in by_kind.items()]
    for w in ws:
        w.neighbours = [o for o in ws if o is not w and shares_compute(w.place.device, o.place.device,
                                                                        w.place.tp, o.place.tp)]
    return ws


def neighbour_factor(span: Span, worker: _Worker, model: ServiceModel) -> float:
    """The slowdown `Compute.factor` gives this worker, averaged over the span's time, from the
    neighbours' spans that overlap it, times its environment's factor (`Compute.wire_env`: a
    CPU worker whose cores another process's worker uses runs with the shared-cores one)."""
    env = model.shared_env(worker.kind) if worker.cpu and any(
        n.instance != worker.instance for n in worker.neighbours) else 1.0
    return env * _busy_factor(span, worker, model)


def _busy_factor(span: Span, worker: _Worker, model: ServiceModel) -> float:
    if span.duration <= 0:
        return 1.0
    busy = [(n, s) for n in worker.neighbours for s in n.overlapping(span.start, span.end)]
    if not busy:
        return 1.0
    cuts = sorted({span.start, span.end, *(t for _, s in busy for t in (s.start, s.end)
                                           if span.start < t < span.end)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid, f, others = (a + b) / 2, 1.0, []
        for n, s in busy:
            if not s.start <= mid < s.end:
                continue
            if worker.cpu and n.instance != worker.instance:
                others.append(n.kind)
            else:
                f += model.slowdown(worker.kind, n.kind, worker.cpu) - 1.0
        total += (b - a) * (f * model.sharing(worker.kind, tuple(sorted(others))) if others else f)
    return total / span.duration


@dataclass(frozen=True)
class StageError:
    median: float | None   # median |log(predicted / measured)| over the stage's spans
    count: int
    ratio: float | None    # median measured / predicted (> 1: the live calls are slower than predicted)
    per_span: tuple[tuple[Span, float], ...] = ()  # (span, predicted seconds, neighbours included)


def service_time_errors(spans: Mapping[str, Sequence[Span]], model: ServiceModel,
                        where: Mapping[str, Placement] | None = None, media: Media = ("image", "224x224"),
                        gateway_media: Media | None = None) -> dict[str, StageError]:
    """Per stage (gateway, encode, prefill, decode): each span's prediction for its batch times
    its neighbours' slowdown, against its measured duration. `where`: each process's device and
    tp (`placements(deployment)`; a process not named is on all CPU cores, tp 1)."""
    where = where or {}
    preds: dict[str, list[tuple[Span, float]]] = {k: [] for k in STAGES}
    for w in _workers(spans, where):
        for s in w.spans:
            base = predicted_s(s, model, w.place.tp, media, gateway_media)
            preds.setdefault(s.kind, []).append((s, base * neighbour_factor(s, w, model)))
    for inst, ss in spans.items():
        for s in ss:
            if s.kind == "gateway":
                preds["gateway"].append((s, predicted_s(s, model, 1, media, gateway_media)))
    out = {}
    for kind, pairs in preds.items():
        ok = [(s, p) for s, p in pairs if s.duration > 0 and p > 0]
        errs = [abs(math.log(p / s.duration)) for s, p in ok]
        out[kind] = StageError(statistics.median(errs) if errs else None, len(errs),
                               statistics.median(s.duration / p for s, p in ok) if ok else None, tuple(ok))
    return out


# ---- 3. the simulator with the measured call times -------------------------------------------------
class MeasuredModel(ServiceModel):
    """A ServiceModel whose encode, prefill and decode call times are the live run's: the
    profile's time for the call times the mean measured / predicted-alone ratio of the live
    spans of that stage and batch size (so a bucket's calls keep their measured busy time, which
    is what a queue waits on: a median would drop the slow calls' tail), else of that stage at
    any batch size, else the profile's time as it is.
    The gateway's likewise when gateway spans are given. The measured spans already hold the
    interference the live calls met, so `slowdown` and `sharing` are 1.0: neighbours do not slow
    a replayed call again. Transfers, media tokens and everything else are the profile's."""

    def __init__(self, profile: Any, spans: Mapping[str, Sequence[Span]], config: ModelConfig | None = None,
                 profiles: Sequence[Any] = (), where: Mapping[str, Placement] | None = None,
                 media: Media = ("image", "224x224"), gateway_media: Media | None = None) -> None:
        super().__init__(profile, config, profiles)
        where = where or {}
        base = ServiceModel(profile, config, profiles)  # the predictions-alone the ratios are taken against
        ratios: dict[tuple[str, int | None], list[float]] = {}
        for inst, ss in spans.items():
            tp = where.get(inst, Placement("cpu")).tp
            for s in ss:
                p = predicted_s(s, base, tp, media, gateway_media)
                if s.duration > 0 and p > 0:
                    for key in ((s.kind, s.batch), (s.kind, None)):
                        ratios.setdefault(key, []).append(s.duration / p)
        self.ratios = {k: statistics.fmean(v) for k, v in ratios.items()}

    def ratio(self, kind: str, batch: int | None) -> float:
        r = self.ratios.get((kind, batch))
        return r if r is not None else self.ratios.get((kind, None), 1.0)

    def gateway_s(self, modality: str, media: str) -> float:
        return super().gateway_s(modality, media) * self.ratio("gateway", None)

    def encode_s(self, batch: int, share: float, modality: str, media: str, tp: int = 1) -> float:
        return super().encode_s(batch, share, modality, media, tp) * self.ratio("encode", batch)

    def prefill_s(self, total_tokens: int, batch: int, tp: int = 1) -> float:
        return super().prefill_s(total_tokens, batch, tp) * self.ratio("prefill", batch)

    def decode_step_s(self, batch: int, context: int, tp: int = 1) -> float:
        return super().decode_step_s(batch, context, tp) * self.ratio("decode", batch)

    cores_shared = False  # the measured call times include the host threads' share of the cores too

    def slowdown(self, stage: str, by: str, cpu: bool = False) -> float:
        return 1.0

    def sharing(self, stage: str, busy: tuple[str, ...]) -> float:
        return 1.0

    def shared_env(self, stage: str) -> float:
        return 1.0


def replay_requests(live_records: Iterable, model: ServiceModel, media: Mapping[str, str]) -> list[SimRequest]:
    """The live run's own arrivals and sizes as SimRequests: each record's send time, modality,
    prompt tokens (less its media's placeholders) and output tokens; `media`: modality -> the
    profile's media label of the run's workload."""
    out = []
    for r in live_records:
        d = _rec(r)
        mod = d["modality"] if d.get("modality") in ("image", "video", "audio") else "text"
        label = media.get(mod, "") if mod != "text" else ""
        text = max(1, int(d.get("prompt_tokens") or 1) - model.media_tokens(mod, label))
        out.append(SimRequest(int(d["index"]), max(0.0, float(d["sent_s"])), mod, label, text,
                              max(1, int(d.get("output_tokens") or 1))))
    return out


# ---- 4. queueing error ------------------------------------------------------------------------------
def _rec(r) -> dict:
    return r if isinstance(r, Mapping) else r.to_dict()


def ttfts(records: Iterable) -> dict[int, float]:
    """Request index -> TTFT seconds, for the records that got a first token without an error."""
    out = {}
    for r in records:
        d = _rec(r)
        if d.get("error") is None and d.get("chunk_s"):
            out[int(d["index"])] = float(d["chunk_s"][0]) - float(d["sent_s"])
    return out


def replay_ttft_error(live_records: Iterable, sim_records: Iterable) -> dict:
    """Per-request TTFT, joined on the request index (both served): "ttft_err_median", the median
    over requests of |log(sim / live)|; "replay_ttft_p50_err", |log(sim TTFT p50 / live TTFT p50)|
    over the joined requests; their p50s in seconds and "n", how many joined (None with none)."""
    live, sim = ttfts(live_records), ttfts(sim_records)
    both = sorted(i for i in live.keys() & sim.keys() if live[i] > 0 and sim[i] > 0)
    if not both:
        return {"n": 0, "ttft_err_median": None, "replay_ttft_p50_err": None, "live_p50_s": None, "sim_p50_s": None}
    lp, sp = statistics.median(live[i] for i in both), statistics.median(sim[i] for i in both)
    return {"n": len(both), "ttft_err_median": statistics.median(abs(math.log(sim[i] / live[i])) for i in both),
            "replay_ttft_p50_err": abs(math.log(sp / lp)), "live_p50_s": lp, "sim_p50_s": sp}
