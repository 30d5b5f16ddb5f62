"""Typed OpenAI request bodies (pydantic v2, strict types): a wrong type, range or shape
anywhere in a body becomes one `BadRequest` naming the field and what to change.

Unknown fields are ignored, as OpenAI does. Known fields this server cannot honour and
that would change the answer (tools, penalties, ...) are accepted in the schema
and refused by `refuse_unsupported` unless absent or at their neutral value.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from easerve.errors import BadRequest
from easerve.policy.admission import Priority, TierName
from easerve.types import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY

U32 = (1 << 32) - 1


# ---- lone surrogates / invalid unicode -----------------------------------------------------
def check_unicode(body: Any) -> None:
    """Every string (key or value) in a decoded JSON body must be valid unicode: no lone
    UTF-16 surrogates (JSON's "\\ud800" escape decodes to one; no tokenizer encodes it).
    Iterative, so a deeply nested body cannot exhaust the stack."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path or "the body")
                todo.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{path or 'the body'}: invalid unicode at character {e.start} (a lone "
                         f"UTF-16 surrogate {text[e.start]!r}); send valid UTF-8 text") from None


# ---- pydantic errors -> one message ---------------------------------------------------------
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (union member tags such as
    'str' or 'dict[any,any]' left out)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(err: ValidationError, limit: int = 4) -> str:
    """pydantic's error list -> 'field: problem (got X); other: problem'."""
    msgs = []
    for e in err.errors(include_url=False)[:limit]:
        path = field_path(e["loc"])
        if not path:
            msgs.append("the request body must be a JSON object")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if e["type"] in ("missing", "value_error") else f" (got {_short(e.get('input'))})"
        msgs.append(f"{path}: {msg}{got}" if e["type"] != "missing" else f"{path}: required field missing")
    more = len(err.errors()) - limit
    return "; ".join(msgs) + (f"; and {more} more" if more > 0 else "")


def validate(model: type[BaseModel], body: Any) -> BaseModel:
    check_unicode(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(describe(e)) from None


# ---- shared field types -------------------------------------------------------------------
def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _content(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in value]


NonEmpty = Annotated[str, Field(min_length=1)]
Stop = Annotated[list[NonEmpty], BeforeValidator(_one_or_many), Field(max_length=64)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class ContentPart(_Model):
    """A content part's shape is checked here (an object with a 'type'); its payload is
    checked where it is converted (`openai_api.convert_part`)."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: NonEmpty


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[list[ContentPart], BeforeValidator(_content), Field(min_length=1)]
    name: str | None = None


class SamplingBody(_Model):
    """Fields both APIs share."""
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=U32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=U32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=U32)] | None = None  # -1 or 0: disabled (vLLM's -1)
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=U32)]], Field(max_length=64)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    timeout: Annotated[float, Field(gt=0.0, le=86400.0)] | None = None  # seconds (an EAServe extension)
    slo_tier: TierName | None = None     # EAServe extensions: SLO-aware admission (--admission)
    priority: Priority | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=U32)] | None = None
    # token id (a string, as JSON keys are) -> bias in [-100, 100]
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None


class ChatBody(SamplingBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    response_format: dict | None = None


def _prompt(value: Any) -> Any:
    """str | [str] | [int, ...] | [[int, ...]] -> str or a list of ints."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ValueError(f"{len(value)} prompts in one request are not supported; send one request per prompt")
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if isinstance(value, list) and value and all(type(v) is int and v >= 0 for v in value):
        return value
    raise ValueError("must be a non-empty string, or a non-empty list of token ids (ints >= 0)")


class CompletionBody(SamplingBody):
    prompt: Annotated[str | list[int], BeforeValidator(_prompt)]
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


# ---- known but unsupported ------------------------------------------------------------------
# field -> neutral values (None, i.e. absent, is always neutral)
_NEUTRAL: dict[str, tuple] = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},), "echo": (False,), "suffix": ("",), "best_of": (1,),
}


def refuse_unsupported(body: SamplingBody) -> None:
    """400 for an option that would change the answer and that this server cannot honour."""
    if body.n not in (None, 1):
        raise BadRequest(f"n: n > 1 is not supported (got {body.n}); send {body.n} requests")
    if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
        raise BadRequest(f"top_logprobs: needs logprobs: true (got top_logprobs {body.top_logprobs} without it)")
    for key, neutral in _NEUTRAL.items():
        value = getattr(body, key, None)
        if value is not None and value not in neutral:
            raise BadRequest(f"{key}: not supported by this server (got {_short(value)}); remove it")
