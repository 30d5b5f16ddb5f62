"""SDK arguments -> a `GenerateRequest` proto: media in every accepted form, chat messages, sampling.

Local checks raise `InvalidRequest` (a ValueError) before anything is sent; media are sent as
bytes and decoded by the gateway, which fetches no URLs.
"""
from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterable

from easerve.errors import InvalidRequest
from easerve.wire.sampling_proto import sampling_to_proto
from easerve.types import SamplingParams, StructuredOutput
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import gateway_pb2 as gpb


def _read_path(value, what: str) -> bytes:
    path = os.fspath(value)
    if path.startswith(("http://", "https://")):
        raise InvalidRequest(f"{what}: the server fetches no URLs; pass the bytes, a file path or a data: URI")
    if not os.path.isfile(path):
        raise InvalidRequest(f"{what}: {path!r} is neither an existing file nor a data: URI")
    with open(path, "rb") as f:
        return f.read()


def _image_bytes(img, what: str = "image") -> bytes:
    if isinstance(img, (bytes, bytearray, memoryview)):
        return bytes(img)
    if isinstance(img, (str, os.PathLike)):
        return _read_path(img, what)
    if hasattr(img, "__array__") and not hasattr(img, "save"):
        from PIL import Image
        img = Image.fromarray(img.__array__())
    if hasattr(img, "save"):  # PIL.Image
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()
    raise InvalidRequest(f"{what}: expected bytes, a PIL image, a file path or a data: URI, "
                              f"got {type(img).__name__}")


def _is_data_uri(v) -> bool:
    return isinstance(v, str) and v.startswith("data:")


def image_part(img) -> gpb.ContentPart:
    if _is_data_uri(img):
        return gpb.ContentPart(image=gpb.ImageInput(url=img))
    return gpb.ContentPart(image=gpb.ImageInput(data=_image_bytes(img)))


def video_part(video, fps: float = 0.0) -> gpb.ContentPart:
    if _is_data_uri(video):
        v = gpb.VideoInput(url=video, fps=fps)
    elif isinstance(video, (bytes, bytearray, memoryview, str, os.PathLike)):
        v = gpb.VideoInput(file=_image_bytes(video, "video"), fps=fps)
    elif isinstance(video, Iterable) or hasattr(video, "__array__"):
        frames = [_image_bytes(f, "video frame") for f in video]
        if not frames:
            raise InvalidRequest("video: the list of frames is empty")
        v = gpb.VideoInput(frames=gpb.VideoFrames(frames=frames), fps=fps)
    else:
        raise InvalidRequest(f"video: expected a list of frames or a video file, got {type(video).__name__}")
    return gpb.ContentPart(video=v)


def audio_part(audio) -> gpb.ContentPart:
    if _is_data_uri(audio):
        return gpb.ContentPart(audio=gpb.AudioInput(url=audio))
    if isinstance(audio, tuple) and len(audio) == 2:
        import numpy as np
        samples, rate = audio
        arr = np.asarray(samples, dtype="<f4")
        if arr.ndim != 1 or int(rate) <= 0:
            raise InvalidRequest("audio: pass (mono 1-D float32 samples, sample_rate > 0)")
        return gpb.ContentPart(audio=gpb.AudioInput(
            samples=gpb.AudioSamples(f32le=arr.tobytes(), sample_rate=int(rate))))
    if isinstance(audio, (bytes, bytearray, memoryview, str, os.PathLike)):
        return gpb.ContentPart(audio=gpb.AudioInput(wav=_image_bytes(audio, "audio")))
    raise InvalidRequest(f"audio: expected WAV bytes, a path or (samples, sample_rate), got {type(audio).__name__}")


def _url(v) -> str:
    return v["url"] if isinstance(v, dict) else v


_PART_BUILDERS = {
    "image": lambda d: image_part(d["image"]),
    "image_url": lambda d: image_part(_url(d["image_url"])),
    "video": lambda d: video_part(d["video"], float(d.get("fps", 0.0))),
    "video_url": lambda d: video_part(_url(d["video_url"])),
    "audio": lambda d: audio_part(d["audio"]),
    "input_audio": lambda d: audio_part(base64.b64decode(d["input_audio"]["data"])),
    "text": lambda d: gpb.ContentPart(text=d["text"]),
}


def content_part(part) -> gpb.ContentPart:
    """A str, a proto ContentPart, or a dict {"type": text|image|image_url|video|video_url|audio|input_audio}."""
    if isinstance(part, gpb.ContentPart):
        return part
    if isinstance(part, str):
        return gpb.ContentPart(text=part)
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _PART_BUILDERS:
        raise InvalidRequest(f"content part {part!r:.80}: 'type' must be one of {sorted(_PART_BUILDERS)}")
    try:
        return _PART_BUILDERS[kind](part)
    except KeyError as e:
        raise InvalidRequest(f"content part of type {kind!r} lacks the key {e}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(f"content part of type {kind!r}: {e}") from None


def chat_message(m) -> gpb.ChatMessage:
    if isinstance(m, gpb.ChatMessage):
        return m
    if not isinstance(m, dict) or "content" not in m:
        raise InvalidRequest("each message must be a dict with 'role' and 'content'")
    content = m["content"]
    parts = [content] if isinstance(content, str) else list(content)
    return gpb.ChatMessage(role=m.get("role", "user"), content=[content_part(p) for p in parts])


def _is_media(x) -> bool:
    return isinstance(x, (bytes, bytearray, str, os.PathLike)) or hasattr(x, "save") or hasattr(x, "__array__")


def media_parts(images=(), video=None, audio=None, video_fps: float = 0.0) -> list[gpb.ContentPart]:
    imgs = [images] if _is_media(images) and not isinstance(images, (list, tuple)) else list(images or ())
    parts = [image_part(i) for i in imgs]
    if video is not None:
        parts.append(video_part(video, video_fps))
    if audio is not None:
        parts.append(audio_part(audio))
    return parts


def sampling_proto(max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   seed: int | None = None, stop=(), stop_token_ids=(), ignore_eos: bool = False,
                   logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                   repetition_penalty: float = 1.0, min_p: float = 0.0, min_tokens: int = 0,
                   logit_bias: dict[int, float] | None = None, response_format: dict | None = None,
                   structured_outputs: dict | None = None, n: int = 1) -> cpb.SamplingParams:
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        structured = [StructuredOutput.from_response_format(response_format) if response_format else None,
                      StructuredOutput.from_vllm(structured_outputs) if structured_outputs else None]
        if all(structured):
            raise InvalidRequest("pass only one of response_format and structured_outputs")
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           stop=stop, stop_token_ids=tuple(int(t) for t in stop_token_ids), ignore_eos=ignore_eos,
                           logprobs=logprobs, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                           repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens,
                           logit_bias=logit_bias or {}, structured=structured[0] or structured[1], n=n)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if seed is not None and seed < 0:
        raise InvalidRequest(f"seed must be >= 0, got {seed}")
    return sampling_to_proto(p)


def build_request(prompt: str | None = None, *, messages=None, raw_prompt: str | None = None, images=(),
                  video=None, audio=None, video_fps: float = 0.0, model: str = "", request_id: str | None = None,
                  **sampling) -> gpb.GenerateRequest:
    """The GenerateRequest for the SDK arguments (see `Client.generate`)."""
    given = sum(x is not None for x in (prompt, messages, raw_prompt))
    if given > 1:
        raise InvalidRequest("pass only one of prompt, messages and raw_prompt")
    media = media_parts(images, video, audio, video_fps)
    if given == 0 and not media:
        raise InvalidRequest("nothing to generate from: pass prompt, messages or raw_prompt")
    req = gpb.GenerateRequest(model=model or "", request_id=request_id or "", sampling=sampling_proto(**sampling))
    if raw_prompt is not None:
        if not raw_prompt:
            raise InvalidRequest("raw_prompt is empty; pass the prompt text with its placeholders")
        req.prompt = raw_prompt
        req.media.extend(media)
    elif messages is not None:
        if media:
            raise InvalidRequest("with messages=, put images/video/audio inside the messages' content")
        req.messages.extend(chat_message(m) for m in messages)
        if not req.messages:
            raise InvalidRequest("messages is empty; pass at least one message")
    else:
        text = [gpb.ContentPart(text=prompt)] if prompt else []
        req.messages.append(gpb.ChatMessage(role="user", content=media + text))
    return req
