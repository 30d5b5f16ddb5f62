"""Typed OpenAI request bodies (pydantic v2, strict types): a wrong type, range or shape
anywhere in a body becomes one `BadRequest` naming the field and what to change.

Unknown fields are ignored, as OpenAI does. Known fields this server cannot honour and
that would change the answer (`functions`, `echo`, ...) are accepted in the schema
and refused by `refuse_unsupported` unless absent or at their neutral value.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from easerve.errors import BadRequest
from easerve.policy.admission import Priority, TierName
from easerve.types import MAX_LOGIT_BIAS, MAX_N, MAX_REPETITION_PENALTY

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


class FunctionCall(_Model):
    name: NonEmpty
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[ContentPart], BeforeValidator(_content), Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None            # a tool turn: the call it answers

    @model_validator(mode="after")
    def _needs_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self


class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; absent: any object
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Model):
    name: NonEmpty


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: exactly one of these."""
    json_spec: dict | str | None = Field(default=None, alias="json")
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [k for k in ("json_spec", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object; got "
                             + (", ".join("json" if k == "json_spec" else k for k in given) or "none"))
        return self


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
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # choices: one prefill, n decodes
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatBody(SamplingBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[dict] | None = None


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
    "functions": ([],), "echo": (False,), "suffix": ("",), "best_of": (1,),
}


def refuse_unsupported(body: SamplingBody) -> None:
    """400 for an option that would change the answer and that this server cannot honour."""
    if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
        raise BadRequest(f"top_logprobs: needs logprobs: true (got top_logprobs {body.top_logprobs} without it)")
    for key, neutral in _NEUTRAL.items():
        value = getattr(body, key, None)
        if value is not None and value not in neutral:
            raise BadRequest(f"{key}: not supported by this server (got {_short(value)}); remove it")
