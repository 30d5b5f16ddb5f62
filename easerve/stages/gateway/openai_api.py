"""OpenAI chat-completions and completions bodies <-> EAServe domain objects (pure, no I/O).

Bodies are validated by the typed models of `openai_schema` (400 naming the field).

Accepted content parts (vLLM's names): text, image_url ({"url": data: URI, base64, http(s)://
or file:// URL}), video_url ({"url": ..., "fps": optional sampling rate} of an MP4 / WebM / MKV /
MOV / GIF / WebP file, or {"frames": [image URIs], "fps": their rate}), input_audio ({"data": base64 file,
"format": "wav" | "flac" | "mp3" | "ogg" | "m4a" | ...}) and audio_url ({"url": ...}).
Messages become frozen `easerve.types.ChatMessage`s here, their media parts `MediaPart`s holding
`MediaRef`s; `MediaResolver` fetches and decodes them off the event loop before preprocessing.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from easerve.errors import BadRequest, InvalidRequest
from easerve.types import ChatMessage, ContentPart, MediaPart, MediaRef, SamplingParams, TextPart
from easerve.stages.gateway import openai_schema as osc
from easerve.stages.gateway import tools as tl


@dataclass
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]  # media parts hold MediaRefs until GatewayCore resolves them
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    timeout_s: float | None = None
    slo_tier: str | None = None
    priority: str | None = None
    tools: tl.ToolPlan | None = None  # answers are parsed for tool calls when set


AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg", "opus", "m4a", "aac", "mp4", "webm")
# content part type -> the modality it needs
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}


def _url_of(part: dict, key: str) -> str:
    val = part.get(key)
    url = val.get("url") if isinstance(val, dict) else val
    if not isinstance(url, str) or not url.strip():
        raise BadRequest(f"content part '{key}' needs {{\"url\": \"data:...;base64,...\" or an http(s):// URL}}")
    return url


def _video_ref(part: dict) -> MediaRef:
    val = part.get("video_url")
    fps = val.get("fps") if isinstance(val, dict) else None
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise BadRequest(f"video_url.fps must be a positive number (frames per second to sample), got {fps!r}")
    if isinstance(val, dict) and "frames" in val:
        frames = val["frames"]
        if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
            raise BadRequest("video_url.frames must be a list of image data: URIs or URLs")
        return MediaRef("video", list(frames), fps=fps)  # the frames' own rate
    return MediaRef("video", _url_of(part, "video_url"), fps=fps)


def _audio_ref(part: dict) -> MediaRef:
    if part["type"] == "audio_url":
        return MediaRef("audio", _url_of(part, "audio_url"))
    val = part.get("input_audio")
    if not isinstance(val, dict) or not isinstance(val.get("data"), str):
        raise BadRequest("content part 'input_audio' needs {\"data\": <base64 audio file>, \"format\": \"wav\"}")
    fmt = val.get("format", "wav")
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"input_audio format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}")
    return MediaRef("audio", val["data"])


def convert_part(part, modalities: tuple[str, ...], sampling_rate: int | None = None) -> ContentPart:
    """One OpenAI content part -> a `TextPart`, or a `MediaPart` holding an unresolved `MediaRef`
    (`sampling_rate` is unused since audio is decoded by `MediaResolver`; kept for callers)."""
    if isinstance(part, str):
        return TextPart(part)
    if not isinstance(part, dict) or "type" not in part:
        raise BadRequest("each content part must be an object with a 'type'")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequest("text part needs a string 'text'")
        return TextPart(part["text"])
    if kind not in MEDIA_PARTS:
        raise BadRequest(f"unsupported content part type {kind!r}; use text, {', '.join(MEDIA_PARTS)}")
    need = MEDIA_PARTS[kind]
    if need not in modalities:
        raise BadRequest(f"this model takes {', '.join(modalities) or 'text only'}; "
                         f"content part type {kind!r} is not supported")
    if need == "image":
        ref = MediaRef("image", _url_of(part, "image_url"))
    elif need == "video":
        ref = _video_ref(part)
    else:
        ref = _audio_ref(part)
    return MediaPart(need, ref)


def convert_messages(messages: list[osc.Message], modalities: tuple[str, ...],
                     sampling_rate: int | None, plan: tl.ToolPlan | None = None) -> tuple[ChatMessage, ...]:
    """Validated messages -> chat messages (media not fetched yet); a part's error names its path.
    Tool turns and earlier calls take the hermes form (`tools`); offered tools join the system message."""
    out = []
    for i, m in enumerate(messages):
        parts = []
        for j, part in enumerate(m.content or ()):
            try:
                parts.append(convert_part(part.model_dump(), modalities, sampling_rate))
            except BadRequest as e:
                raise BadRequest(f"messages[{i}].content[{j}]: {e}") from None
        role = {"developer": "system", "tool": "user"}.get(m.role, m.role)
        if m.role == "tool":
            if any(not isinstance(p, TextPart) for p in parts):
                raise BadRequest(f"messages[{i}]: a tool message's content must be text")
            parts = [TextPart(tl.response_text("".join(p.text for p in parts)))]
        for call in m.tool_calls or ():
            try:
                parts.append(TextPart(("\n" if parts else "") + tl.call_text(call.function.name, call.function.arguments)))
            except BadRequest as e:
                raise BadRequest(f"messages[{i}].{e}") from None
        out.append(ChatMessage(role, tuple(parts)))
    if plan is not None:
        block = tl.tools_system_text(plan.functions)
        if out and out[0].role == "system":
            out[0] = ChatMessage("system", (*out[0].content, TextPart("\n\n" + block)))
        else:
            out.insert(0, ChatMessage("system", (TextPart(block),)))
    return tuple(out)


def sampling_from(body: osc.SamplingBody, default_max_tokens: int, plan: tl.ToolPlan | None = None) -> SamplingParams:
    """Validated body -> SamplingParams (OpenAI defaults; max_completion_tokens wins over max_tokens;
    the structured output of response_format, structured_outputs or a forced tool call)."""
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    structured = tl.structured_from(body, plan)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            seed=None if body.seed is None else body.seed % (1 << 64),
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            logprobs=_logprobs_k(body),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            min_tokens=body.min_tokens or 0,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            structured=structured,
            n=1 if body.n is None else body.n,
        )
    except InvalidRequest as e:
        raise BadRequest(f"bad sampling parameter: {e}") from None


def _logprobs_k(body: osc.SamplingBody) -> int | None:
    """How many alternatives per token the body asks for (None: no logprobs)."""
    if isinstance(body, osc.ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(lps, tokenizer) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(tid: int, lp: float) -> dict:
        tok = _token(tokenizer, tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
    return {"content": [{**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for tid, lp in lps]}


def text_logprobs(lps, tokenizer, offset: int = 0) -> dict:
    """OpenAI (legacy) completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [_token(tokenizer, tid) for tid, _ in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    def top(lp) -> dict:  # keyed by text: where two pieces decode alike, the likelier one stays
        out: dict[str, float] = {}
        for t, v in lp.top:
            out.setdefault(_token(tokenizer, t), v)
        return out
    return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in lps],
            "top_logprobs": [top(lp) for _, lp in lps], "text_offset": offsets}


def _check_model(body: osc.SamplingBody, served_model: str) -> str:
    model = served_model if body.model is None else body.model
    if model != served_model:
        raise BadRequest(f"model: {model!r} is not served here; GET /v1/models lists {served_model!r}")
    return model


def parse_chat_request(body, served_model: str, modalities: tuple[str, ...],
                       sampling_rate: int | None, default_max_tokens: int = 256) -> ChatRequest:
    """A decoded JSON body of POST /v1/chat/completions -> ChatRequest, or BadRequest."""
    chat = osc.validate(osc.ChatBody, body)
    model = _check_model(chat, served_model)
    osc.refuse_unsupported(chat)
    opts = chat.stream_options or osc.StreamOptions()
    plan = tl.tool_plan(chat)
    return ChatRequest(model=model,
                       messages=convert_messages(chat.messages, modalities, sampling_rate, plan),
                       sampling=sampling_from(chat, default_max_tokens, plan),
                       stream=bool(chat.stream), include_usage=opts.include_usage,
                       timeout_s=chat.timeout, slo_tier=chat.slo_tier, priority=chat.priority, tools=plan)


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]         # text, or token ids
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    timeout_s: float | None = None
    slo_tier: str | None = None
    priority: str | None = None


def parse_completion_request(body, served_model: str, vocab_size: int,
                             default_max_tokens: int = 16) -> CompletionRequest:
    """A decoded JSON body of POST /v1/completions -> CompletionRequest, or BadRequest."""
    comp = osc.validate(osc.CompletionBody, body)
    model = _check_model(comp, served_model)
    osc.refuse_unsupported(comp)
    if isinstance(comp.prompt, list):
        bad = [t for t in comp.prompt if t >= vocab_size]
        if bad:
            raise BadRequest(f"prompt: token id {bad[0]} is out of range; this model's vocabulary "
                             f"has ids 0..{vocab_size - 1}")
    opts = comp.stream_options or osc.StreamOptions()
    return CompletionRequest(model=model, prompt=comp.prompt, sampling=sampling_from(comp, default_max_tokens),
                             stream=bool(comp.stream), include_usage=opts.include_usage, timeout_s=comp.timeout,
                             slo_tier=comp.slo_tier, priority=comp.priority)


def chunk_json(req: ChatRequest, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"id": req.request_id, "object": "chat.completion.chunk", "created": created,
            "model": req.model, "choices": [choice]}


def usage_json(last) -> dict:
    """OpenAI's usage block from a request's last `Delta`: `cached_tokens`, prompt tokens prefill's
    prefix cache answered; `easerve.migrations`, times the stream moved to another decode instance."""
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
            "easerve": {"migrations": last.migrations}}


def completion_json(req: ChatRequest, text: str, finish_reason: str, usage: dict,
                    logprobs: dict | None = None, index: int = 0) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if req.tools is not None:
        message["content"], calls = tl.split_tool_calls(text)
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"id": req.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage}


def text_chunk_json(req: CompletionRequest, created: int, text: str, finish_reason: str | None,
                    logprobs: dict | None = None, index: int = 0) -> dict:
    """One SSE event of a streamed /v1/completions answer (choice `index`)."""
    return {"id": req.request_id, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def text_completion_json(req: CompletionRequest, text: str, finish_reason: str, usage: dict,
                         logprobs: dict | None = None, index: int = 0) -> dict:
    return {**text_chunk_json(req, int(time.time()), text, finish_reason, logprobs, index), "usage": usage}


def error_json(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def models_json(served_model: str, max_model_len: int, created: int = 0) -> dict:
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "easerve", "max_model_len": max_model_len}]}
