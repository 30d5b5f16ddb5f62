"""The profile file (`"format": "easerve.profile/v1"`): what `hasctl profile` measured, read by
`hasctl screen`, `hasctl bench --slo`, the discrete-event simulator and SLO-aware admission.

Documented field by field in docs/profile-format.md. Every measurement is a *latency* of one
call at one operating point (seconds), so a simulator can draw service times from it; the
throughputs (items/s, tokens/s) are derived from those latencies, never stored twice. The
lookups below (`encode_latency`, `prefill_latency`, `decode_step_s`) interpolate linearly
between measured points and extrapolate along the last segment. `load` / `from_dict` validate
and raise ValueError naming the field and what to change; `dump` writes indented JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hasctl.bench_metrics import SLO

FORMAT = "easerve.profile/v1"
TIERS = ("tight", "moderate", "loose")
DEFAULT_MULTIPLIERS = {"tight": 2.0, "moderate": 4.0, "loose": 8.0}


def _positive(where: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{where} must be a finite number > 0, got {v!r}; re-run hasctl profile")


def _count(where: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where} must be an int >= 1, got {v!r}")


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    cores: int                    # logical cores the profile process was allowed to use
    gpus: tuple[str, ...] = ()    # names of the GPUs given (empty on a CPU run)
    device: str = "cpu"           # where the stages were measured: "cuda:0" or "cpu:0-1"
    devices: tuple[str, ...] = ("cpu",)  # every device given; screen assumes they are alike


@dataclass(frozen=True)
class Versions:
    easerve: str
    torch: str
    transformers: str
    python: str


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str
    config_sha256: str            # of config.json's bytes: a profile belongs to one checkpoint
    modalities: tuple[str, ...]   # media kinds the model takes


@dataclass(frozen=True)
class EncodePoint:
    """adapter.encode of `batch_size` reference items under compute share `share`."""
    batch_size: int
    share: float
    latency_s: float

    def check(self, where: str) -> None:
        _count(f"{where}.batch_size", self.batch_size)
        if not 0 < self.share <= 1:
            raise ValueError(f"{where}.share must be in (0, 1], got {self.share!r}")
        _positive(f"{where}.latency_s", self.latency_s)


@dataclass(frozen=True)
class EncodeSizePoint:
    """adapter.encode of `batch_size` items of one modality and media size at share 1.0."""
    modality: str
    media: str                    # "224x224" (image), "8x112x112" (video FxWxH), "2.0s" (audio)
    tokens_per_item: int          # embedding rows one item yields (its prompt placeholders)
    batch_size: int
    latency_s: float

    def check(self, where: str) -> None:
        _count(f"{where}.tokens_per_item", self.tokens_per_item)
        _count(f"{where}.batch_size", self.batch_size)
        _positive(f"{where}.latency_s", self.latency_s)


@dataclass(frozen=True)
class EncodeProfile:
    backend: str                  # sm backend the shares ran on: green_contexts, cpu_affinity, none
    backend_note: str             # why (e.g. "no partition backend here: share 1.0 only")
    reference_modality: str
    reference_media: str          # the media the grid was measured on
    grid: tuple[EncodePoint, ...]  # batch sizes x shares, reference media
    by_size: tuple[EncodeSizePoint, ...] = ()

    def check(self, where: str) -> None:
        if not self.grid:
            raise ValueError(f"{where}.grid is empty; profile at least batch 1 at share 1.0")
        for i, p in enumerate(self.grid):
            p.check(f"{where}.grid[{i}]")
        if not any(p.share == 1.0 for p in self.grid):
            raise ValueError(f"{where}.grid has no share 1.0 point (the exclusive baseline); re-run hasctl profile")
        for i, p in enumerate(self.by_size):
            p.check(f"{where}.by_size[{i}]")

    @property
    def shares(self) -> tuple[float, ...]:
        return tuple(sorted({p.share for p in self.grid}))


@dataclass(frozen=True)
class PrefillPoint:
    """`batch_size` text-only prompts of `prompt_len` tokens through adapter.prefill."""
    prompt_len: int
    batch_size: int
    latency_s: float

    def check(self, where: str) -> None:
        _count(f"{where}.prompt_len", self.prompt_len)
        _count(f"{where}.batch_size", self.batch_size)
        _positive(f"{where}.latency_s", self.latency_s)

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_len * self.batch_size / self.latency_s


@dataclass(frozen=True)
class DecodePoint:
    """One DecodeEngine.step with `batch_size` running requests (context `context_len`)."""
    batch_size: int
    step_s: float
    context_len: int = 0

    def check(self, where: str) -> None:
        _count(f"{where}.batch_size", self.batch_size)
        _positive(f"{where}.step_s", self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.step_s


@dataclass(frozen=True)
class Unloaded:
    """One request alone through encode -> prefill -> decode, in process."""
    modality: str                 # image, video, audio or text
    media: str                    # its media size ("" for text)
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float

    def check(self, where: str) -> None:
        _count(f"{where}.prompt_tokens", self.prompt_tokens)
        _count(f"{where}.output_tokens", self.output_tokens)
        _positive(f"{where}.ttft_s", self.ttft_s)
        _positive(f"{where}.tpot_s", self.tpot_s)


@dataclass(frozen=True)
class TierLimit:
    modality: str
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class Tier:
    """SLO tier: `multiplier` x the unloaded TTFT and TPOT of each modality."""
    name: str
    multiplier: float
    limits: tuple[TierLimit, ...]

    def check(self, where: str) -> None:
        _positive(f"{where}.multiplier", self.multiplier)
        if not self.limits:
            raise ValueError(f"{where}.limits is empty; give one limit per modality")
        for i, lim in enumerate(self.limits):
            _positive(f"{where}.limits[{i}].ttft_ms", lim.ttft_ms)
            _positive(f"{where}.limits[{i}].tpot_ms", lim.tpot_ms)


def tiers_from(unloaded: Sequence[Unloaded], multipliers: dict[str, float] | None = None) -> tuple[Tier, ...]:
    m = multipliers or DEFAULT_MULTIPLIERS
    return tuple(Tier(name, m[name], tuple(TierLimit(u.modality, u.ttft_s * 1e3 * m[name], u.tpot_s * 1e3 * m[name])
                                           for u in unloaded)) for name in TIERS)


@dataclass(frozen=True)
class Profile:
    hardware: Hardware
    versions: Versions
    model: ModelInfo
    encode: EncodeProfile | None  # None for a text-only model
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    unloaded: tuple[Unloaded, ...]
    tiers: tuple[Tier, ...]
    created_utc: str = ""
    quick: bool = False           # measured with --quick (few points, one repeat): for tests
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {self.format!r}; re-run hasctl profile")
        if self.encode is not None:
            self.encode.check("encode")
        for name in ("prefill", "decode", "unloaded"):
            pts = getattr(self, name)
            if not pts:
                raise ValueError(f"{name} is empty; re-run hasctl profile")
            for i, p in enumerate(pts):
                p.check(f"{name}[{i}]")
        names = [t.name for t in self.tiers]
        if sorted(names) != sorted(TIERS):
            raise ValueError(f"tiers must be exactly {list(TIERS)}, got {names}")
        for t in self.tiers:
            t.check(f"tiers.{t.name}")

    # ---- lookups (what screen, the simulator and admission call) ------------------------------
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
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a {FORMAT} profile (format: {got!r}); write one with hasctl profile")
        return _build(cls, data, "profile")


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


def load(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read the profile {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-run hasctl profile") from None
    try:
        return Profile.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---- generic, checked construction from JSON -----------------------------------------------------
def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _value(hints[k], v, f"{where}.{k}") for k, v in data.items()})


def _value(tp: Any, v: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), v, where)
    if origin is tuple:
        if not isinstance(v, list):
            raise ValueError(f"{where} must be a list, got {type(v).__name__}")
        return tuple(_value(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where)
    ok = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}[tp]
    if not isinstance(v, ok) or (tp is not bool and isinstance(v, bool)):
        raise ValueError(f"{where} must be a {tp.__name__}, got {v!r}")
    return float(v) if tp is float else v
