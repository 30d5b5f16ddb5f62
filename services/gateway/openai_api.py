"""OpenAI chat-completions schema <-> EAServe domain objects (pure, no I/O).

Accepted content parts (vLLM's names): text, image_url ({"url": data: URI, base64, http(s)://
or file:// URL}), video_url ({"url": ..., "fps": optional sampling rate} of an MP4 / WebM / MKV /
MOV / GIF / WebP file, or {"frames": [image URIs], "fps": their rate}), input_audio ({"data": base64 file,
"format": "wav" | "flac" | "mp3" | "ogg" | "m4a" | ...}) and audio_url ({"url": ...}).
Media parts become `easerve.media.MediaRef`s here; `MediaResolver` fetches and decodes them
off the event loop before preprocessing.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from easerve import media
from easerve.rpc.errors import InvalidRequest
from easerve.types import SamplingParams


class BadRequest(InvalidRequest):
    """Client error: HTTP 400 / INVALID_ARGUMENT, message says what to change."""


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]            # HF-style; media values are MediaRefs until GatewayCore resolves them
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    timeout_s: float | None = None


AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg", "opus", "m4a", "aac", "mp4", "webm")
# content part type -> the modality it needs
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}


def _url_of(part: dict, key: str) -> str:
    val = part.get(key)
    url = val.get("url") if isinstance(val, dict) else val
    if not isinstance(url, str) or not url.strip():
        raise BadRequest(f"content part '{key}' needs {{\"url\": \"data:...;base64,...\" or an http(s):// URL}}")
    return url


def _video_ref(part: dict) -> media.MediaRef:
    val = part.get("video_url")
    fps = val.get("fps") if isinstance(val, dict) else None
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise BadRequest(f"video_url.fps must be a positive number (frames per second to sample), got {fps!r}")
    if isinstance(val, dict) and "frames" in val:
        frames = val["frames"]
        if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
            raise BadRequest("video_url.frames must be a list of image data: URIs or URLs")
        return media.MediaRef("video", list(frames), fps=fps)  # the frames' own rate
    return media.MediaRef("video", _url_of(part, "video_url"), fps=fps)


def _audio_ref(part: dict) -> media.MediaRef:
    if part["type"] == "audio_url":
        return media.MediaRef("audio", _url_of(part, "audio_url"))
    val = part.get("input_audio")
    if not isinstance(val, dict) or not isinstance(val.get("data"), str):
        raise BadRequest("content part 'input_audio' needs {\"data\": <base64 audio file>, \"format\": \"wav\"}")
    fmt = val.get("format", "wav")
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"input_audio format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}")
    return media.MediaRef("audio", val["data"])


def convert_part(part, modalities: tuple[str, ...], sampling_rate: int | None = None) -> dict:
    """One OpenAI content part -> an HF-style part; media values are unresolved `MediaRef`s
    (`sampling_rate` is unused since audio is decoded by `MediaResolver`; kept for callers)."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or "type" not in part:
        raise BadRequest("each content part must be an object with a 'type'")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequest("text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind not in MEDIA_PARTS:
        raise BadRequest(f"unsupported content part type {kind!r}; use text, {', '.join(MEDIA_PARTS)}")
    need = MEDIA_PARTS[kind]
    if need not in modalities:
        raise BadRequest(f"this model takes {', '.join(modalities) or 'text only'}; "
                         f"content part type {kind!r} is not supported")
    if need == "image":
        ref = media.MediaRef("image", _url_of(part, "image_url"))
    elif need == "video":
        ref = _video_ref(part)
    else:
        ref = _audio_ref(part)
    return {"type": need, need: ref}


def convert_messages(raw, modalities: tuple[str, ...], sampling_rate: int | None) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest("each message needs a 'role' of system, user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = [convert_part(p, modalities, sampling_rate) for p in content]
        else:
            raise BadRequest("message 'content' must be a string or a list of content parts")
        out.append({"role": m["role"], "content": parts})
    return out


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise BadRequest("'stop' must be a string or a list of strings")


def _opt(body: dict, key: str, default):
    val = body.get(key)
    return default if val is None else val


def sampling_from(body: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_opt(body, "temperature", 1.0)),
            top_p=float(_opt(body, "top_p", 1.0)),
            top_k=int(body.get("top_k") or 0),
            seed=body.get("seed"),
            stop=_stop(body),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling parameter: {e}") from None


# Options that would change the answer: refused unless absent or at their neutral value.
_NEUTRAL = {"tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "logit_bias": ({},),
            "response_format": ({"type": "text"},), "logprobs": (False,), "top_logprobs": (0,),
            "presence_penalty": (0,), "frequency_penalty": (0,)}


def _refuse_unsupported(body: dict) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value not in neutral:
            raise BadRequest(f"'{key}' is not supported by this server; remove it")


def parse_chat_request(body, served_model: str, modalities: tuple[str, ...],
                       sampling_rate: int | None, default_max_tokens: int = 256) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", served_model)
    if model != served_model:
        raise BadRequest(f"model {model!r} is not served here; GET /v1/models lists {served_model!r}")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    _refuse_unsupported(body)
    opts = body.get("stream_options") or {}
    return ChatRequest(model=model,
                       messages=convert_messages(body.get("messages"), modalities, sampling_rate),
                       sampling=sampling_from(body, default_max_tokens),
                       stream=bool(body.get("stream", False)),
                       include_usage=bool(opts.get("include_usage", False)),
                       timeout_s=body.get("timeout"))


def chunk_json(req: ChatRequest, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": req.request_id, "object": "chat.completion.chunk", "created": created,
            "model": req.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_json(req: ChatRequest, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict:
    return {"id": req.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason}],
            "usage": usage_json(prompt_tokens, completion_tokens)}


def error_json(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def models_json(served_model: str, max_model_len: int, created: int = 0) -> dict:
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                        "owned_by": "easerve", "max_model_len": max_model_len}]}
