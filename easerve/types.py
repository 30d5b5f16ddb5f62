"""Domain types shared by every stage. Torch appears only as tensor annotations.

These are the typed objects that cross module boundaries (and, through
`easerve.wire.codec`, process boundaries). Keep them small and frozen where possible.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Union
from collections.abc import Sequence

from easerve.errors import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    import torch

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[str, ...] = ("image", "video", "audio")
Role = Literal["encode", "prefill", "decode", "full", "processor"]
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
MAX_REPETITION_PENALTY = 100.0
MAX_N = 16  # choices per request (`SamplingParams.n`)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{id: bias} or [(id, bias), ...] -> sorted ((id, bias), ...); ids in 0..2**32-1, bias in [-100, 100]."""
    pairs = list(value.items()) if isinstance(value, dict) else list(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or type(pair[0]) is not int \
                or not 0 <= pair[0] < (1 << 32):
            raise InvalidRequest(f"logit_bias keys must be token ids (ints >= 0), got {pair!r}")
        if type(pair[1]) not in (int, float):
            raise InvalidRequest(f"logit_bias values must be numbers, got {pair[1]!r} for token {pair[0]}")
        bias = float(pair[1])
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {pair[1]!r} for token {pair[0]}")
        out[pair[0]] = bias
    return tuple(sorted(out.items()))


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
MAX_STRUCTURED_SPEC = 1 << 20  # characters of a schema, regex or grammar


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (`easerve.engine.grammar` compiles it): `json` (spec: a JSON
    schema's text), `json_object` (any JSON object; spec empty), `regex`, `choice` (spec: a JSON
    list of strings), `grammar` (EBNF, xgrammar's dialect), `tool_calls` (spec: a JSON object
    {"functions": [{"name", "parameters"}], "multiple": bool}: hermes `<tool_call>` blocks)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC:
            raise InvalidRequest(f"structured output spec must be a string of at most {MAX_STRUCTURED_SPEC} characters")
        if not self.spec and self.kind != "json_object":
            raise InvalidRequest(f"structured output {self.kind!r} needs a non-empty spec")

    @classmethod
    def from_vllm(cls, d: dict) -> "StructuredOutput":
        """vLLM's `structured_outputs` ({"json": schema} / regex / choice / grammar / json_object: true)."""
        if not isinstance(d, dict):
            raise InvalidRequest(f"structured_outputs must be an object, got {d!r:.60}")
        given = {k: v for k, v in d.items() if v is not None and v is not False}
        if len(given) != 1 or not set(given) <= {"json", "regex", "choice", "grammar", "json_object"}:
            raise InvalidRequest("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {sorted(given) or 'none'}")
        (key, value), = given.items()
        if key == "json":
            return cls("json", value if isinstance(value, str) else json.dumps(value))
        if key == "choice":
            return cls("choice", json.dumps(list(value)))
        return cls("json_object") if key == "json_object" else cls(key, value)

    @classmethod
    def from_response_format(cls, d: dict) -> "StructuredOutput | None":
        """OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema"}}."""
        kind = d.get("type") if isinstance(d, dict) else None
        if kind == "json_schema" and isinstance(d.get("json_schema"), dict) and "schema" in d["json_schema"]:
            return cls("json", json.dumps(d["json_schema"]["schema"]))
        if kind in ("text", "json_object"):
            return None if kind == "text" else cls("json_object")
        raise InvalidRequest(f"response_format must be {{\"type\": \"json_schema\", \"json_schema\": "
                             f"{{\"name\": ..., \"schema\": {{...}}}}}}, json_object or text; got {d!r:.80}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob and the top k
    # vLLM's options: the logit transforms (easerve.engine.logit_transforms) and min_p (the sampler)
    presence_penalty: float = 0.0    # -= this once for every token generated so far
    frequency_penalty: float = 0.0   # -= this times how often each token was generated
    repetition_penalty: float = 1.0  # prompt + generated tokens: positive logits / r, negative * r
    min_p: float = 0.0               # drop tokens whose probability < min_p * the top one's
    min_tokens: int = 0              # EOS and stop_token_ids are masked until this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to logits
    structured: StructuredOutput | None = None       # tokens outside the grammar are masked
    n: int = 1  # choices: one prefill, n decodes sharing the prompt's KV (each its own `choice(i)`)
    # A migrated request (the gateway's mid-stream migration): the tokens it generated before,
    # which also end its input_ids. The stop rules, the detokenizer and the logit transforms
    # replay them, the sampler counts its steps from len(resumed) on (a seeded request draws
    # what it would have drawn uninterrupted), and they count against max_tokens.
    resumed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if type(self.n) is not int or not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be an integer in 1..{MAX_N} (choices per request), got {self.n!r}")
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in 0..{MAX_LOGPROBS} (top tokens per position), got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 disables it), "
                                 f"got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.structured, dict):  # the wire header's form
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequest(f"structured must be a StructuredOutput, got {self.structured!r}")
        if self.resumed and (self.n != 1 or len(self.resumed) >= self.max_tokens):
            raise InvalidRequest(f"resumed ({len(self.resumed)} tokens) needs n = 1 and fewer tokens than "
                                 f"max_tokens ({self.max_tokens})")
        if self.structured is not None and self.min_tokens:
            raise InvalidRequest("min_tokens cannot be combined with a structured output (its grammar says "
                                 "where the output ends); drop min_tokens")

    @property
    def transforms_logits(self) -> bool:
        """True when a penalty, a bias, min_tokens or a grammar changes the logits before
        sampling (greedy rows included); min_p, top-k and top-p only filter sampled rows."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def tokens_left(self) -> int:
        """Tokens still to generate: max_tokens less the resumed ones."""
        return self.max_tokens - len(self.resumed)

    def prompt_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The prompt part of a request's input_ids (a resumed request's end with `resumed`)."""
        return list(input_ids[:len(input_ids) - len(self.resumed)])

    def choice(self, i: int) -> "SamplingParams":
        """The sampling of choice i (0..n-1) alone (n = 1). With a seed, choice i samples with
        seed + i (mod 2**64): a seeded choice is reproducible on any instance, choice 0 draws what
        the same request with n = 1 draws, and two choices of one request differ."""
        if not 0 <= i < self.n:
            raise ValueError(f"choice {i} of a request with n = {self.n}")
        seed = None if self.seed is None else (self.seed + i) % (1 << 64)
        return self if self.n == 1 else replace(self, n=1, seed=seed)


@dataclass
class MMItem:
    """One media item after the HF processor, in prompt order.

    `pixels` holds the heavy processor outputs only the encoder needs (pixel_values,
    input_features, ...). `meta` holds the small tensors that prefill also needs
    (image_sizes, image_grid_thw, video_grid_thw, second_per_grid_ts, feature lengths).
    `num_tokens` is how many placeholder tokens this item fills in input_ids.
    `content_hash` (easerve.media.content_hash; empty: not cacheable) keys the encoder cache.
    `replacement` (gateway only, never sent) is the text the HF processor put in place of
    the item's placeholder string; with `meta` and `num_tokens` it lets the gateway build a
    prompt for the same media again without the processor (`HFAdapter.prompt_from_items`).
    """

    modality: str
    pixels: dict[str, "torch.Tensor"]
    meta: dict[str, "torch.Tensor"]
    num_tokens: int
    content_hash: bytes = b""
    replacement: str = ""


@dataclass
class ProcessedPrompt:
    """What the gateway produces: token ids with placeholders, plus media items."""

    input_ids: list[int]
    items: list[MMItem] = field(default_factory=list)


@dataclass(frozen=True)
class ItemMeta:
    """What prefill needs of one media item besides its embedding rows: its modality and the
    small meta tensors (`MMItem.meta`: grids, sizes, feature lengths), and its content hash
    (`MMItem.content_hash`; the prefix cache names its placeholders by it)."""

    modality: str
    meta: dict[str, "torch.Tensor"]
    content_hash: bytes = b""


def items_meta(items: list[MMItem]) -> list[ItemMeta]:
    return [ItemMeta(it.modality, it.meta, it.content_hash) for it in items]


@dataclass
class PrefillRequest:
    """What prefill consumes: token ids, one embedding tensor per media item
    ([num_tokens, hidden], prompt order), and each item's meta."""

    request_id: str
    input_ids: list[int]
    embeddings: list["torch.Tensor"]
    items_meta: list[ItemMeta]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class PrefillResult:
    """KV of the prompt ([kv_heads, T, head_dim] per layer), the last position's logits,
    and the per-request position state (rope_delta is 0 except for M-RoPE models)."""

    request_id: str
    keys: list["torch.Tensor"]
    values: list["torch.Tensor"]
    last_logits: "torch.Tensor"
    prompt_len: int
    rope_delta: int = 0
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class CachedPrefix:
    """The KV of a prompt's first `num_tokens` tokens, from the prefix cache: per layer
    [kv_heads, num_tokens, head_dim]. Prefill computes only the tokens after them."""

    keys: list["torch.Tensor"]
    values: list["torch.Tensor"]
    num_tokens: int


@dataclass
class KVPayload:
    """Everything decode needs to continue a request: the prompt KV, the first token
    (already sampled by prefill), positions and sampling state. Crosses processes
    through `easerve.wire.codec` (raw tensors + typed header, never pickle)."""

    request_id: str
    keys: list["torch.Tensor"]
    values: list["torch.Tensor"]
    prompt_len: int
    rope_delta: int
    first_token: int
    sampling: SamplingParams
    prompt_ids_tail: list[int] = field(default_factory=list)  # for stop strings / detok context
    penalty_ids: list[int] = field(default_factory=list)  # distinct prompt ids, for repetition_penalty
    first_tokens: list[int] = field(default_factory=list)  # sampling.n > 1: choice i's first token at i

    @property
    def choice_tokens(self) -> list[int]:
        """Every choice's first token, choice 0 first (just `first_token` when n = 1)."""
        return list(self.first_tokens) or [self.first_token]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0


@dataclass(frozen=True)
class Timings:
    """Milliseconds measured along a request's chain; 0 = not measured (common.proto's Timings)."""

    ttft_ms: float = 0.0
    queue_ms: float = 0.0
    encode_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    embed_transfer_ms: float = 0.0
    tpot_ms: float = 0.0
    encode_cache_hits: int = 0  # not a time: media items answered by the encoder cache
    preprocess_ms: float = 0.0
    preprocess_skipped: bool = False  # not a time: the gateway neither decoded the media nor ran the processor

    def merge(self, other: Timings | None) -> Timings:
        """Fields measured in `other` win."""
        if other is None:
            return self
        return Timings(**{f.name: getattr(other, f.name) or getattr(self, f.name) for f in fields(self)})


# ---- chat messages: built once where a request enters (the gateway's fronts), read by the adapter ----
@dataclass(frozen=True)
class MediaRef:
    """One media item as sent: bytes, base64, a data: URI, a URL, a frame list or samples.
    `easerve.media.MediaResolver` fetches a URL into a new MediaRef holding the bytes."""

    kind: str
    source: Any
    fps: float | None = None          # video: for files, frames per second to sample (None: the model's);
                                      # for frame lists, their frame rate
    sample_rate: int | None = None    # raw audio samples: their rate

    def __post_init__(self) -> None:
        if self.kind not in MODALITIES:
            raise ValueError(f"media kind must be one of {MODALITIES}, got {self.kind!r}")


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPart:
    """An image, video or audio content part: as sent (`ref`), or decoded (`value`: a PIL image,
    video frames as a list of images or a [T, H, W, C] array, mono float32 samples at the model's
    rate; `fps`: the rate of decoded video frames, when known). `MediaResolver.resolve` returns
    decoded parts; library callers may build them decoded."""

    kind: str
    ref: MediaRef | None = None
    value: Any = None
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in MODALITIES:
            raise ValueError(f"media kind must be one of {MODALITIES}, got {self.kind!r}")
        if self.ref is None and self.value is None:
            raise ValueError(f"a {self.kind} part needs a MediaRef or a decoded value")

    @property
    def decoded(self) -> bool:
        return self.value is not None


ContentPart = Union[TextPart, MediaPart]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: tuple[ContentPart, ...]

    @property
    def media(self) -> tuple[MediaPart, ...]:
        return tuple(p for p in self.content if isinstance(p, MediaPart))


def media_parts(messages: tuple[ChatMessage, ...]) -> list[MediaPart]:
    """The media parts of `messages`, in request order."""
    return [p for m in messages for p in m.media]


def with_media(messages: tuple[ChatMessage, ...], parts: list[MediaPart]) -> tuple[ChatMessage, ...]:
    """New messages whose media parts are `parts` (as many as `media_parts(messages)`, same order)."""
    it = iter(parts)
    return tuple(ChatMessage(m.role, tuple(next(it) if isinstance(p, MediaPart) else p for p in m.content))
                 for m in messages)


def as_messages(messages) -> tuple[ChatMessage, ...]:
    """`ChatMessage`s as they are; HF-style dicts (library callers: {"role", "content": str or
    [{"type": "text", "text"}, {"type": "image" | "video" | "audio", kind: value, "fps"?}]}) read once
    into them, a `MediaRef` value as sent, any other value as decoded."""
    if all(isinstance(m, ChatMessage) for m in messages):
        return tuple(messages)
    return tuple(m if isinstance(m, ChatMessage) else _message_from_hf(m) for m in messages)


def _message_from_hf(m: dict) -> ChatMessage:
    content = m.get("content", ())
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return ChatMessage(m.get("role", "user"), tuple(_part_from_hf(p) for p in parts))


def _part_from_hf(p: dict) -> ContentPart:
    kind = p.get("type")
    if kind == "text":
        return TextPart(p["text"])
    if kind not in MODALITIES or kind not in p:
        raise InvalidRequest(f"content part {p!r:.80}: expected {{'type': 'text', 'text': ...}} or "
                             f"{{'type': kind, kind: value}} with kind one of {MODALITIES}")
    value = p[kind]
    if isinstance(value, MediaRef):
        return MediaPart(kind, ref=value, fps=p.get("fps"))
    return MediaPart(kind, value=value, fps=p.get("fps"))
