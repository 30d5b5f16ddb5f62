"""The profile file (`"format": "easerve.profile/v1"`): what `hasctl profile` measured (scope
"full"), or the encode grid alone that a co-located encode worker measured at start-up (scope
"encode"). Read by `hasctl screen`, `hasctl bench --slo`, `hasctl tune`, `hasctl simulate` (easerve/sim)
and the encode worker's `--partition-profile`.

Documented field by field in docs/profile-format.md. Every measurement is a *latency* of one
call at one operating point (seconds); the throughputs (items/s, tokens/s) are derived from
those latencies, never stored twice. The lookups below (`encode_latency`, `prefill_latency`,
`decode_step_s`) interpolate linearly between measured points and extrapolate along the last
segment.

The types are frozen pydantic dataclasses: each field states its type and bounds, and `load` /
`from_dict` validate a file with `TypeAdapter(Profile).validate_json(..., strict=True)`, raising
ValueError that names the field path and what to change. A new optional field is one line with
a default (older files then load without it); `dump` writes indented JSON.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, get_args

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from easerve.slo import SLO

FORMAT = "easerve.profile/v1"
REVISION = 6                      # what hasctl profile writes: 2 adds gateway, transfer, interference; 4 adds sharing;
#                                  5: gateway points are the live gateway's preprocessing CPU (hasctl/profile_gateway.py);
#                                  6 adds shared_env
ROOFLINE_REVISION = 3             # 3 adds measured, tp, roofline (written by hasctl profile --roofline)
OLD_STARTUP_FORMAT = "easerve.sm_profile"  # the encode start-up's own file before profile/v1
TIERS = ("tight", "moderate", "loose")
DEFAULT_MULTIPLIERS = {"tight": 2.0, "moderate": 4.0, "loose": 8.0}
SCOPES = ("full", "encode")
HINT = "re-run hasctl profile"

# strict: no "3" -> 3, no true -> 1; JSON numbers may be ints where a float is asked
_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
Seconds = Annotated[float, Field(gt=0)]      # a measured latency: finite, > 0
Count = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(gt=0, le=1)]  # fraction of the device's compute


@dataclass(frozen=True, config=_CONFIG)
class Hardware:
    cpu_model: str
    cores: Count                  # logical cores the profile process was allowed to use
    gpus: tuple[str, ...] = ()    # names of the GPUs given (empty on a CPU run)
    device: str = "cpu"           # where the stages were measured: "cuda:0" or "cpu:0-1"
    devices: tuple[str, ...] = ("cpu",)  # every device given; screen assumes they are alike


@dataclass(frozen=True, config=_CONFIG)
class Versions:
    easerve: str
    torch: str
    transformers: str
    python: str


@dataclass(frozen=True, config=_CONFIG)
class ModelInfo:
    path: str
    family: str
    config_sha256: str            # of config.json's bytes: a profile belongs to one checkpoint
    modalities: tuple[str, ...]   # media kinds the model takes


@dataclass(frozen=True, config=_CONFIG)
class EncodePoint:
    """adapter.encode of `batch_size` reference items under compute share `share`."""
    batch_size: Count
    share: Share
    latency_s: Seconds


@dataclass(frozen=True, config=_CONFIG)
class EncodeSizePoint:
    """adapter.encode of `batch_size` items of one modality and media size at share 1.0."""
    modality: str
    media: str                    # "224x224" (image), "8x112x112" (video FxWxH), "2s" (audio)
    tokens_per_item: Count        # embedding rows one item yields (its prompt placeholders)
    batch_size: Count
    latency_s: Seconds


@dataclass(frozen=True, config=_CONFIG)
class EncodeProfile:
    """The encode stage: latency by batch size x share (`grid`) and by media size (`by_size`)."""
    backend: str                  # partition backend the shares ran on: green_contexts, cpu_affinity, none
    backend_note: str             # why (e.g. "no partition backend here: share 1.0 only")
    reference_modality: str
    reference_media: str          # the media the grid was measured on
    grid: tuple[EncodePoint, ...]  # batch sizes x shares, reference media
    by_size: tuple[EncodeSizePoint, ...] = ()

    def __post_init__(self) -> None:
        if not self.grid:
            raise ValueError(f"grid is empty; profile at least batch 1 at share 1.0 ({HINT})")
        if not any(p.share == 1.0 for p in self.grid):
            raise ValueError(f"grid has no share 1.0 point (the exclusive baseline); {HINT}")

    @property
    def shares(self) -> tuple[float, ...]:
        return tuple(sorted({p.share for p in self.grid}))


@dataclass(frozen=True, config=_CONFIG)
class PrefillPoint:
    """`batch_size` text-only prompts of `prompt_len` tokens through adapter.prefill."""
    prompt_len: Count
    batch_size: Count
    latency_s: Seconds

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_len * self.batch_size / self.latency_s


@dataclass(frozen=True, config=_CONFIG)
class DecodePoint:
    """One DecodeEngine.step with `batch_size` running requests (context `context_len`)."""
    batch_size: Count
    step_s: Seconds
    context_len: Annotated[int, Field(ge=0)] = 0

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.step_s


@dataclass(frozen=True, config=_CONFIG)
class Unloaded:
    """One request alone through encode -> prefill -> decode, in process."""
    modality: str                 # image, video, audio or text
    media: str                    # its media size ("" for text)
    prompt_tokens: Count
    output_tokens: Count
    ttft_s: Seconds
    tpot_s: Seconds


@dataclass(frozen=True, config=_CONFIG)
class TierLimit:
    modality: str
    ttft_ms: Seconds
    tpot_ms: Seconds


@dataclass(frozen=True, config=_CONFIG)
class Tier:
    """SLO tier: `multiplier` x the unloaded TTFT and TPOT of each modality."""
    name: Literal["tight", "moderate", "loose"]
    multiplier: Seconds
    limits: Annotated[tuple[TierLimit, ...], Field(min_length=1)]


def tiers_from(unloaded: Sequence[Unloaded], multipliers: dict[str, float] | None = None) -> tuple[Tier, ...]:
    m = multipliers or DEFAULT_MULTIPLIERS
    return tuple(Tier(name, m[name], tuple(TierLimit(u.modality, u.ttft_s * 1e3 * m[name], u.tpot_s * 1e3 * m[name])
                                           for u in unloaded)) for name in TIERS)


LinkKind = Literal["same_device", "same_host", "other_host"]
Stage = Literal["gateway", "encode", "prefill", "decode"]
LINK_KINDS: tuple[str, ...] = get_args(LinkKind)
STAGES: tuple[str, ...] = get_args(Stage)


@dataclass(frozen=True, config=_CONFIG)
class GatewayPoint:
    """Revision 2: the gateway's preprocessing of one request for one modality and media size.
    From revision 5, the host CPU seconds of the gateway's own parse, media decode and tokenize
    phases for a request body as a client sends it (hasctl/profile_gateway.py; the figure the live
    gateway's GET /trace reports per request); before, the wall time of the HF processor and
    tokenizer on media already decoded."""
    modality: str
    media: str                    # as in EncodeSizePoint ("" for text)
    latency_s: Seconds


@dataclass(frozen=True, config=_CONFIG)
class LinkPoint:
    """Revision 2: bytes between two stages over one kind of link: `latency_s + bytes / (gb_per_s * 1e9)`."""
    kind: LinkKind
    gb_per_s: Annotated[float, Field(gt=0)]
    latency_s: Annotated[float, Field(ge=0)] = 0.0
    measured: bool = True         # False: a stated assumption (e.g. other_host on one machine)


@dataclass(frozen=True, config=_CONFIG)
class Transfer:
    """Revision 2: what moves between stages. Embedding rows and KV per prompt token, in bytes."""
    embed_bytes_per_token: Count
    kv_bytes_per_token: Count
    links: tuple[LinkPoint, ...] = ()


@dataclass(frozen=True, config=_CONFIG)
class Interference:
    """Revision 2: `stage`'s latency is multiplied by `slowdown` while `by` runs on the same
    device (co-located encode + prefill on a GPU) or the same CPU cores."""
    stage: Stage
    by: Stage
    slowdown: Annotated[float, Field(gt=0)]


@dataclass(frozen=True, config=_CONFIG)
class SharingPoint:
    """Revision 4: `stage`'s latency is multiplied by `slowdown` while `busy` other processes,
    each running stage `by`, compute on the same `cores` CPU cores (processor sharing between
    processes; every process with a torch thread per core, as the stages run)."""
    stage: Stage
    by: Stage
    busy: Count
    slowdown: Annotated[float, Field(gt=0)]
    cores: Count


@dataclass(frozen=True, config=_CONFIG)
class SharedEnvPoint:
    """Revision 6: `stage`'s reference call alone in a process started with the environment of
    the workers that share CPU cores (hasctl.deployment.SHARED_CORES_ENV) over the same call
    alone in the profiling process, where every latency of the file is timed: the factor such a
    worker runs at with no neighbour busy (the sharing curve is relative to it)."""
    stage: Stage
    slowdown: Annotated[float, Field(gt=0)]


@dataclass(frozen=True, config=_CONFIG)
class Roofline:
    """Revision 3: how a derived (`measured: false`) profile was computed (`hasctl profile --roofline`):
    the device spec, its figures' source and the efficiency factors applied (easerve/roofline/spec.py)."""
    device: str                   # spec name, e.g. "rtx6000-ada"
    source: str                   # where the spec's figures come from
    dtype: str
    tflops: Annotated[float, Field(gt=0)]
    mem_gb_per_s: Annotated[float, Field(gt=0)]
    interconnect_gb_per_s: Annotated[float, Field(gt=0)]
    compute_eff: Share
    memory_eff: Share
    layer_overhead_s: Annotated[float, Field(ge=0)]
    call_overhead_s: Annotated[float, Field(ge=0)]
    kv_gib_per_device: Annotated[float, Field(gt=0)] | None = None  # a decode / monolith GPU's KV budget (None: unstated)
    encode_call_overhead_s: Annotated[float, Field(ge=0)] = 0.0  # added to every encode call (easerve/roofline/spec.py)


@dataclass(frozen=True, config=_CONFIG)
class Profile:
    """scope "full": every stage (hasctl profile); "encode": `encode` alone (an encode
    worker's start-up), with the other stages empty."""
    hardware: Hardware
    versions: Versions
    model: ModelInfo
    encode: EncodeProfile | None  # None for a text-only model
    prefill: tuple[PrefillPoint, ...] = ()
    decode: tuple[DecodePoint, ...] = ()
    unloaded: tuple[Unloaded, ...] = ()
    tiers: tuple[Tier, ...] = ()
    created_utc: str = ""
    quick: bool = False           # measured with --quick (few points, one repeat): for tests
    format: Literal["easerve.profile/v1"] = FORMAT
    scope: Literal["full", "encode"] = "full"
    # revision 2 (all optional: a revision-1 file loads with none of them)
    revision: Literal[1, 2, 3, 4, 5, 6] = 1
    gateway: tuple[GatewayPoint, ...] = ()
    transfer: Transfer | None = None
    interference: tuple[Interference, ...] = ()
    # revision 3 (optional): derived profiles and tensor-parallel instances
    measured: bool = True         # False: computed by the roofline model, not measured
    tp: Count = 1                 # devices one instance of each stage spans (tensor parallel)
    roofline: Roofline | None = None
    # revision 4 (optional): CPU sharing between processes
    sharing: tuple[SharingPoint, ...] = ()
    # revision 6 (optional): the shared-cores environment's own cost
    shared_env: tuple[SharedEnvPoint, ...] = ()

    def __post_init__(self) -> None:
        if self.scope == "encode":
            if self.encode is None:
                raise ValueError("scope 'encode' needs the encode stage; it is null")
            return
        for name in ("prefill", "decode", "unloaded"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty; {HINT}")
        names = [t.name for t in self.tiers]
        if sorted(names) != sorted(TIERS):
            raise ValueError(f"tiers must be exactly {list(TIERS)}, got {names}")

    # ---- lookups (what hasctl screen and the simulator call) ----------------------------------------------------
    def encode_latency(self, batch_size: int, share: float = 1.0, modality: str | None = None,
                       media: str | None = None) -> float:
        """Seconds for one encode call of `batch_size` items. The grid gives the reference media;
        another modality / size scales it by the batch-1 ratio of their `by_size` points."""
        enc = self._encode()
        level = next((s for s in enc.shares if s >= share - 1e-9), 1.0)
        pts = sorted((p.batch_size, p.latency_s) for p in enc.grid if p.share == level)
        lat = _interp(pts, batch_size)
        if modality is None or (modality == enc.reference_modality and media in (None, enc.reference_media)):
            return lat
        return lat * self._size_b1(modality, media) / self._size_b1(enc.reference_modality, enc.reference_media)

    def encode_capacity(self, share: float = 1.0, modality: str | None = None, max_batch: int | None = None) -> float:
        """Items/s of one encode instance at its best profiled batch size (<= max_batch)."""
        sizes = sorted({p.batch_size for p in self._encode().grid if max_batch is None or p.batch_size <= max_batch})
        if not sizes:
            raise ValueError(f"no encode batch size <= {max_batch} was profiled")
        return max(b / self.encode_latency(b, share, modality) for b in sizes)

    def prefill_latency(self, prompt_len: int, batch_size: int = 1) -> float:
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for p in self.prefill:
            by_batch.setdefault(p.batch_size, []).append((p.prompt_len, p.latency_s))
        per_batch = sorted((b, _interp(sorted(v), prompt_len)) for b, v in by_batch.items())
        return _interp(per_batch, batch_size)

    def prefill_capacity(self, prompt_len: int) -> float:
        """Prompt tokens/s of one prefill instance at its best profiled batch, for this prompt length."""
        return max(prompt_len * b / self.prefill_latency(prompt_len, b) for b in {p.batch_size for p in self.prefill})

    def _decode_at(self, context_len: int | None) -> list[DecodePoint]:
        """The decode points of the measured context nearest `context_len` (None: the smallest)."""
        ctxs = sorted({p.context_len for p in self.decode})
        ctx = ctxs[0] if context_len is None else min(ctxs, key=lambda c: (abs(c - context_len), c))
        return sorted((p for p in self.decode if p.context_len == ctx), key=lambda p: p.batch_size)

    def decode_step_s(self, batch_size: int, context_len: int | None = None) -> float:
        return _interp([(p.batch_size, p.step_s) for p in self._decode_at(context_len)], batch_size)

    def decode_capacity(self, max_batch: int | None = None, context_len: int | None = None) -> float:
        """Output tokens/s of one decode instance at its best profiled batch (<= max_batch)."""
        at = self._decode_at(context_len)
        pts = [p for p in at if max_batch is None or p.batch_size <= max_batch] or at[:1]
        return max(p.tokens_per_s for p in pts)

    def gateway_latency(self, modality: str, media: str | None = None) -> float:
        """Seconds the gateway preprocesses one request: the point of this modality and media,
        else the mean of the modality's points; 0.0 when the profile has none (revision 1)."""
        pts = [g for g in self.gateway if g.modality == modality]
        use = [g for g in pts if g.media == media] or pts
        return sum(g.latency_s for g in use) / len(use) if use else 0.0

    def link(self, kind: str) -> LinkPoint | None:
        """The measured (or stated) link of this kind, or None."""
        if kind not in LINK_KINDS:
            raise ValueError(f"link kind must be one of {list(LINK_KINDS)}, got {kind!r}")
        return next((x for x in self.transfer.links if x.kind == kind), None) if self.transfer else None

    def slowdown(self, stage: str, by: str) -> float:
        """Latency factor of `stage` while `by` shares its device or cores (1.0 when not profiled)."""
        return next((x.slowdown for x in self.interference if x.stage == stage and x.by == by), 1.0)

    def shared_env_slowdown(self, stage: str) -> float:
        """Latency factor of `stage` in a worker started with the shared-cores environment, no
        neighbour busy (1.0 when not measured)."""
        return next((x.slowdown for x in self.shared_env if x.stage == stage), 1.0)

    def sharing_slowdown(self, stage: str, by: str, busy: int) -> float | None:
        """Latency factor of `stage` while `busy` other processes running `by` compute on its
        cores: the measured point, linear between points and along the last segment past them
        (a stage or neighbour not measured takes the mean of the points measured at each count);
        None when the profile has no sharing points."""
        if busy <= 0:
            return 1.0
        pts = ([p for p in self.sharing if p.stage == stage and p.by == by]
               or [p for p in self.sharing if p.stage == stage] or list(self.sharing))
        if not pts:
            return None
        by = {}
        for p in pts:
            by.setdefault(p.busy, []).append(p.slowdown)
        curve = [(0.0, 1.0)] + [(float(k), sum(v) / len(v)) for k, v in sorted(by.items())]
        return max(1.0, _interp(curve, float(busy)))

    def unloaded_for(self, modality: str) -> Unloaded:
        for u in self.unloaded:
            if u.modality == modality:
                return u
        raise ValueError(f"the profile has no unloaded latency for {modality!r}; it has "
                         f"{[u.modality for u in self.unloaded]}")

    def slo(self, tier: str) -> SLO:
        """The tier as bench's SLO: per-modality limits; the default is the loosest of them."""
        t = next((t for t in self.tiers if t.name == tier), None)
        if t is None:
            raise ValueError(f"unknown SLO tier {tier!r}; choose one of {list(TIERS)}")
        lim = t.limits
        return SLO(max(x.ttft_ms for x in lim), max(x.tpot_ms for x in lim),
                   tuple((x.modality, x.ttft_ms, x.tpot_ms) for x in lim), tier=tier)

    def _encode(self) -> EncodeProfile:
        if self.encode is None:
            raise ValueError("this profile has no encode stage (a text-only model)")
        return self.encode

    def _size_b1(self, modality: str, media: str | None) -> float:
        pts = [p for p in self._encode().by_size if p.modality == modality and media in (None, p.media)]
        if not pts:
            raise ValueError(f"the profile has no encode point for {modality} {media or ''}; profile that size")
        return _interp(sorted((p.batch_size, p.latency_s) for p in pts if p.media == pts[0].media), 1)

    # ---- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": self.format, **{k: v for k, v in dataclasses.asdict(self).items() if k != "format"}}

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """A profile from its JSON object (as `json.loads` gives it); ValueError naming the field."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            if got == OLD_STARTUP_FORMAT:
                raise ValueError(f"this is an {OLD_STARTUP_FORMAT} file, the encode worker's start-up profile "
                                 f"before {FORMAT}: delete it (the worker then measures its encode grid again "
                                 f"at start and writes {FORMAT} there), or give a file from hasctl profile")
            raise ValueError(f"not a {FORMAT} profile (format: {got!r}); write one with hasctl profile")
        return _parse(json.dumps(data))


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through sorted points; beyond the ends, along the end segment
    (never below half the nearest measured value: latencies stay positive). One point:
    proportional to x."""
    if len(points) == 1:
        (x0, y0), = points
        return y0 * x / x0
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= x <= b[0])
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    nearest = min(points, key=lambda p: abs(p[0] - x))[1]
    return max(y, 0.5 * nearest)


def dump(profile: Profile, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n")
    return path


def load(path: str | Path, require: Literal["full", "encode"] = "full") -> Profile:
    """The profile at `path`. require "full": every stage measured (what screen, bench and tune
    read); "encode": the encode grid is enough (what the encode worker's start-up reads)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read the profile {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {HINT}") from None
    try:
        prof = Profile.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if require == "full" and prof.scope != "full":
        raise ValueError(f"{path} holds the encode grid alone (scope {prof.scope!r}, written by an encode "
                         f"worker's start-up); this needs every stage: write one with hasctl profile")
    if require == "encode" and prof.encode is None:
        raise ValueError(f"{path} has no encode stage (a text-only model's profile)")
    return prof


_ADAPTER = TypeAdapter(Profile)


def _parse(text: str) -> Profile:
    try:
        return _ADAPTER.validate_json(text, strict=True)
    except ValidationError as e:
        raise ValueError("; ".join(_describe(err) for err in e.errors()[:3])
                         + (f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else "")) from None


def _describe(err: dict) -> str:
    """One pydantic error as `field.path[i]: what is wrong, got X; what to change`."""
    loc = err["loc"]
    path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "profile"
    kind = err["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent, _, key = path.rpartition(".")
        return f"{parent or 'profile'}: unknown key {key!r} (a typo, or a newer format: {HINT})"
    if kind in ("missing_argument", "missing"):
        parent, _, key = path.rpartition(".")
        return f"{parent or 'profile'}: missing key {key!r}; {HINT}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"{path}: {msg}" if loc else msg
    return f"{path}: {msg.replace('Input should be', 'must be')}, got {err.get('input')!r}; {HINT}"
