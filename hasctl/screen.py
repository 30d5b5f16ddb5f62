"""`hasctl screen`: drop the allocations in which some stage cannot carry the target rate.

An allocation puts whole instances of encode (E), prefill (P) and decode (D) on the N devices
(GPUs, or core groups like the one the profile was measured on), one instance per device,
all N used, and says whether encode co-locates prefill. Enumerated: every (e, p, d) with
e + p + d = N and d >= 1; without co-location p >= 1 and e >= 1 (e may be 0 when the workload
has no media); with co-location e >= 1 and p >= 0.

Capacity model (per stage, from the profile alone; demand = rate x the workload's mean per request):
- encode: e x C_E, C_E = the profile's best items/s over batch sizes <= max_batch at share 1.0
  (batch size 1 for the `request_at_a_time` batch mode; for `modality`, scaled from the
  reference media by `Profile.encode_latency`);
  demand = rate x items per request.
- prefill: p x C_P + (co-located: e x C_P x (1 - rho_E)), C_P = the profile's best prompt
  tokens/s at the workload's prompt length, rho_E = encode demand / (e x C_E) the fraction of
  time encode keeps its device busy (co-located prefill gets the rest: a time-sharing bound);
  demand = rate x prompt tokens.
- decode: d x C_D, C_D = the profile's best tokens/s over batches <= max_running, at the
  measured context nearest a request's mean one (prompt + output / 2);
  demand = rate x output tokens.
A stage carries the rate when capacity x max_utilization >= demand. `screen` is pure.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from easerve.policy.batcher import MODES as BATCH_MODES, batch_limit
from easerve.profile_format import Profile, load


@dataclass(frozen=True)
class Demand:
    """The workload: arrival rate and each request's mean work."""
    rate: float
    items: float = 1.0            # encode items per request (0 for text-only)
    prompt_tokens: float = 64.0
    output_tokens: float = 32.0
    modality: str | None = None   # encode cost scale; None = the profile's reference media

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.items < 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("items must be >= 0 and prompt_tokens, output_tokens >= 1 per request")


@dataclass(frozen=True)
class Allocation:
    encode: int
    prefill: int
    decode: int
    colocated: bool = False

    @property
    def name(self) -> str:
        return f"E{self.encode}-P{self.prefill}-D{self.decode}" + ("+coloc" if self.colocated else "")


@dataclass(frozen=True)
class StageCheck:
    stage: str
    capacity: float
    demand: float
    unit: str
    ok: bool

    def describe(self) -> str:
        rel = ">=" if self.ok else "<"
        return f"{self.stage}: capacity {self.capacity:.4g} {self.unit} {rel} demand {self.demand:.4g} {self.unit}"


@dataclass(frozen=True)
class Verdict:
    allocation: Allocation
    checks: tuple[StageCheck, ...]

    @property
    def kept(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def headroom(self) -> float:
        """Capacity over demand of the tightest stage (>= 1: every stage carries the rate)."""
        return min((c.capacity / c.demand for c in self.checks if c.demand > 0), default=float("inf"))

    @property
    def reason(self) -> str:
        bad = [c.describe() for c in self.checks if not c.ok]
        return "; ".join(bad) if bad else "every stage carries the rate"


def enumerate_allocations(devices: int, media: bool = True) -> list[Allocation]:
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    out = []
    for colocated in (False, True):
        for e in range(devices + 1):
            for p in range(devices - e + 1):
                d = devices - e - p
                if d < 1 or (colocated and e < 1) or (not colocated and (p < 1 or (media and e < 1))):
                    continue
                out.append(Allocation(e, p, d, colocated))
    return out


def check(profile: Profile, demand: Demand, a: Allocation, max_batch: int | None = None,
          max_running: int | None = None, max_utilization: float = 1.0, batch_mode: str = "adaptive") -> Verdict:
    u = max_utilization
    checks = []
    enc_need = demand.rate * demand.items
    largest = batch_limit(batch_mode, max_batch)
    c_e = profile.encode_capacity(1.0, demand.modality, largest) if enc_need > 0 else 0.0
    if enc_need > 0:
        checks.append(StageCheck("encode", a.encode * c_e * u, enc_need, "items/s", a.encode * c_e * u >= enc_need))
    c_p = profile.prefill_capacity(max(1, round(demand.prompt_tokens)))
    cap_p = a.prefill * c_p
    if a.colocated:
        rho = enc_need / (a.encode * c_e) if enc_need > 0 else 0.0
        cap_p += a.encode * c_p * max(0.0, 1.0 - rho)
    p_need = demand.rate * demand.prompt_tokens
    checks.append(StageCheck("prefill", cap_p * u, p_need, "tokens/s", cap_p * u >= p_need))
    mean_context = round(demand.prompt_tokens + demand.output_tokens / 2)
    cap_d = a.decode * profile.decode_capacity(max_running, mean_context)
    d_need = demand.rate * demand.output_tokens
    checks.append(StageCheck("decode", cap_d * u, d_need, "tokens/s", cap_d * u >= d_need))
    return Verdict(a, tuple(checks))


def screen(profile: Profile, demand: Demand, devices: int, max_batch: int | None = None,
           max_running: int | None = None, max_utilization: float = 1.0,
           batch_mode: str = "adaptive") -> list[Verdict]:
    """Every allocation over `devices`, each with its stage checks (kept or removed)."""
    if not 0 < max_utilization <= 1:
        raise ValueError(f"max_utilization must be in (0, 1], got {max_utilization}")
    return [check(profile, demand, a, max_batch, max_running, max_utilization, batch_mode)
            for a in enumerate_allocations(devices, media=demand.items > 0)]


def best_allocation(profile: Profile, demand: Demand, allocations, max_batch: int | None = None,
                    batch_mode: str = "adaptive") -> Allocation | None:
    """Of `allocations`, the one of most headroom (its tightest stage's capacity over demand;
    ties: the first), or None when there is none."""
    return max(allocations, key=lambda a: check(profile, demand, a, max_batch, batch_mode=batch_mode).headroom,
               default=None)


def screen_candidates(prof: Profile, rate: float, modality: str | None, allocs, instances: int, max_batch: int,
                      say=print, where: str = "the profile") -> tuple[list, dict]:
    """`hasctl tune`'s screening of its candidate allocations `allocs` (of 2..instances instances)
    at `rate`: the kept ones (each removal said with its reason), and the warm starts' picks among
    them, as `Space` fields: `dynamo_alloc` (the non-colocated one of most headroom with
    request-at-a-time encode) and `screened_best` (the one of most headroom with batches up to `max_batch`)."""
    demand = demand_from(prof, rate, modality)
    verdicts = {v.allocation: v for n in range(2, instances + 1) for v in screen(prof, demand, n, max_batch=max_batch)}
    kept = [a for a in allocs if verdicts[a].kept]
    for a in allocs:
        if not verdicts[a].kept:
            say(f"screened out {a.name}: {verdicts[a].reason}")
    say(f"screening with {where}: {len(kept)} of {len(allocs)} allocations kept (the monolith is not screened)")
    dynamo = best_allocation(prof, demand, [a for a in kept if not a.colocated], 1, "request_at_a_time")
    best = best_allocation(prof, demand, kept, max_batch)
    return kept, {"dynamo_alloc": dynamo.name if dynamo else "", "screened_best": best.name if best else ""}


def demand_from(profile: Profile, rate: float, modality: str | None = None, items: float | None = None,
                prompt_tokens: float | None = None, output_tokens: float | None = None) -> Demand:
    """A Demand from the profile's unloaded request of `modality` (default: the reference one),
    each field overridable."""
    mod = modality or (profile.encode.reference_modality if profile.encode else "text")
    u = profile.unloaded_for(mod)
    return Demand(rate, (0.0 if mod == "text" else 1.0) if items is None else items,
                  u.prompt_tokens if prompt_tokens is None else prompt_tokens,
                  u.output_tokens if output_tokens is None else output_tokens,
                  None if mod == "text" else mod)


# ---- command line ----------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("screen", help="drop allocations in which some stage cannot carry --rate")
    p.add_argument("--profile", required=True, help="a profile file from hasctl profile")
    p.add_argument("--rate", type=float, required=True, help="target arrival rate, requests/s")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to allocate: GPUs, or core groups like the profiled one (default: the profile's); "
                        "with a tensor-parallel profile (tp > 1) each instance takes tp of them")
    p.add_argument("--modality", default=None, help="workload modality (default: the profile's reference)")
    p.add_argument("--items-per-request", type=float, default=None)
    p.add_argument("--prompt-tokens", type=float, default=None, help="default: the profile's unloaded request")
    p.add_argument("--output-tokens", type=float, default=None, help="default: the profile's unloaded request")
    p.add_argument("--max-batch", type=int, default=None, help="encode B: the largest batch counted")
    p.add_argument("--batch-mode", default="adaptive", choices=BATCH_MODES,
                   help="encode batch mode (request_at_a_time counts batches of one)")
    p.add_argument("--max-running", type=int, default=None, help="decode batch cap")
    p.add_argument("--max-utilization", type=float, default=1.0, help="headroom: count capacity x this")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    prof = load(args.profile)
    demand = demand_from(prof, args.rate, args.modality, args.items_per_request, args.prompt_tokens,
                         args.output_tokens)
    gpus = args.devices or len(prof.hardware.devices)
    devices = gpus // prof.tp  # a tensor-parallel profile's instance spans tp devices
    verdicts = screen(prof, demand, devices, args.max_batch, args.max_running, args.max_utilization,
                      args.batch_mode)
    if not verdicts:
        raise ValueError(f"{gpus} device(s) hold no allocation (one instance per device, per {prof.tp} at tp={prof.tp}; "
                         f"the smallest is "
                         f"encode with co-located prefill + decode); pass --devices N (GPUs, or core groups "
                         f"like the profiled {prof.hardware.device})")
    if args.json:
        print(json.dumps({"demand": asdict(demand), "devices": gpus, "instance_slots": devices, "tp": prof.tp, "kept": [_js(v) for v in verdicts if v.kept],
                          "removed": [_js(v) for v in verdicts if not v.kept]}, indent=1))
        return 0
    print(f"demand: {args.rate:g} req/s x ({demand.items:g} items, {demand.prompt_tokens:g} prompt tokens, "
          f"{demand.output_tokens:g} output tokens) over {gpus} devices"
          + (f" ({devices} instances of tp={prof.tp})" if prof.tp > 1 else ""))
    for title, kept in (("kept", True), ("removed", False)):
        rows = [v for v in verdicts if v.kept == kept]
        print(f"{title} ({len(rows)}):")
        for v in rows:
            print(f"  {v.allocation.name:<18} {v.reason}")
    return 0


def _js(v: Verdict) -> dict:
    return {"allocation": asdict(v.allocation), "name": v.allocation.name, "reason": v.reason,
            "checks": [asdict(c) for c in v.checks]}
