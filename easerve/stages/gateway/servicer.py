"""gRPC front of the gateway: easerve.v1.Gateway <-> GatewayCore (thin)."""
from __future__ import annotations

import math
import uuid

import numpy as np

from easerve.rpc.deadline import remaining_from_context
from easerve.rpc.errors import grpc_errors
from easerve.errors import InvalidRequest
from easerve.stages.common.host_time import HostAccount
from easerve.wire.protoconv import FINISH_TO_PROTO
from easerve.types import ChatMessage, ContentPart, MediaPart, MediaRef, TextPart
from easerve.wire.sampling_proto import sampling_from_proto, timings_to_proto
from easerve.wire.v1 import gateway_pb2, gateway_pb2_grpc
from easerve.stages.gateway.admission import PRIORITY_HEADER, TIER_HEADER, checked_priority, checked_tier
from easerve.stages.gateway.choices import ended
from easerve.stages.gateway.core import GatewayCore
from easerve.stages.gateway.job import Job


ROLES = ("", "system", "developer", "user", "assistant")  # the roles of the HTTP API's messages too


def _image(m) -> MediaRef:
    return MediaRef("image", m.data if m.WhichOneof("source") == "data" else m.url)


def _video(m) -> MediaRef:
    """Frames as sent (`fps`: their frame rate), or a file / URL sampled at `fps` frames per
    second (0: the model's default)."""
    src = m.WhichOneof("source")
    if src is None:
        raise InvalidRequest("video part has no source; set frames, file or url")
    if not (math.isfinite(m.fps) and m.fps >= 0):
        raise InvalidRequest(f"video fps must be a finite number >= 0 (0: the model's default), got {m.fps}")
    if src == "frames":
        return MediaRef("video", list(m.frames.frames), fps=m.fps or None)
    return MediaRef("video", m.file if src == "file" else m.url, fps=m.fps or None)


def _audio(m, rate: int | None) -> MediaRef:
    """`wav` holds any audio file PyAV decodes (WAV, FLAC, MP3, Ogg, M4A); `url` a data: URI or URL."""
    if rate is None:
        raise InvalidRequest("this model does not take audio; remove the audio part")
    src = m.WhichOneof("source")
    if src is None:
        raise InvalidRequest("audio part has no source; set wav, samples or url")
    if src == "samples":
        if len(m.samples.f32le) % 4:
            raise InvalidRequest(f"audio samples.f32le has {len(m.samples.f32le)} bytes; send whole float32 values")
        raw = np.frombuffer(m.samples.f32le, dtype="<f4")
        return MediaRef("audio", raw, sample_rate=m.samples.sample_rate)
    return MediaRef("audio", m.wav if src == "wav" else m.url)


def part_from_proto(p, modalities: tuple[str, ...], rate: int | None) -> ContentPart:
    """One proto content part -> a `TextPart`, or a `MediaPart` holding a `MediaRef` that
    `GatewayCore.preprocess` fetches and decodes off the event loop."""
    kind = p.WhichOneof("part")
    if kind is None:
        raise InvalidRequest("empty content part; set text, image, video or audio")
    if kind == "text":
        return TextPart(p.text)
    if kind not in modalities:
        raise InvalidRequest(f"this model takes {', '.join(modalities)}; {kind} parts are not supported")
    value = {"image": _image, "video": _video}.get(kind, lambda m: _audio(m, rate))(getattr(p, kind))
    return MediaPart(kind, value)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    def _job(self, req: gateway_pb2.GenerateRequest, timeout: float | None) -> Job:
        a, cfg = self.core.adapter, self.core.cfg
        if req.model and req.model != cfg.served_model:
            raise InvalidRequest(f"model {req.model!r} is not served here; ListModels lists {cfg.served_model!r}")
        if bool(req.messages) == bool(req.prompt):
            raise InvalidRequest("set exactly one of 'messages' and 'prompt'")
        sampling_msg = req.sampling if req.HasField("sampling") else None
        if sampling_msg is not None and sampling_msg.max_tokens == 0:
            raise InvalidRequest("sampling.max_tokens must be >= 1")
        if sampling_msg is not None and sampling_msg.resumed:
            raise InvalidRequest("sampling.resumed is the gateway's own (mid-stream migration); leave it unset")
        sampling = sampling_from_proto(req.sampling, default_max_tokens=cfg.default_max_tokens)
        rid = req.request_id or f"gen-{uuid.uuid4().hex[:24]}"
        job = Job(sampling, rid, timeout_s=timeout)
        if req.messages:
            for i, m in enumerate(req.messages):
                if m.role not in ROLES:
                    raise InvalidRequest(f"messages[{i}].role {m.role[:40]!r} is not one of {', '.join(ROLES[1:])} "
                                         "(empty: user)")
                if not m.content:
                    raise InvalidRequest(f"messages[{i}] has no content; send at least one part")
            job.messages = tuple(ChatMessage({"": "user", "developer": "system"}.get(m.role, m.role),
                                             tuple(part_from_proto(p, a.modalities, a.sampling_rate)
                                                   for p in m.content))
                                 for m in req.messages)
        else:
            job.prompt = req.prompt
            if any(p.WhichOneof("part") == "text" for p in req.media):
                raise InvalidRequest("media holds a text part; put text in 'prompt', media parts in 'media'")
            job.media = tuple(part_from_proto(p, a.modalities, a.sampling_rate) for p in req.media)
        return job

    @grpc_errors
    async def Generate(self, request, context):
        acc = HostAccount()
        with self.core.host.phase("parse", acc):
            job = self._job(request, remaining_from_context(context))
        job.host = acc
        meta = dict(context.invocation_metadata() or ())
        job.slo_tier = checked_tier(meta.get(TIER_HEADER), f"metadata {TIER_HEADER}")
        job.priority = checked_priority(meta.get(PRIORITY_HEADER), f"metadata {PRIORITY_HEADER}")
        finished = 0
        async for d in self.core.generate(job):
            finished += d.finish_reason is not None
            with self.core.host.phase("detokenize", job.host):
                msg = self._response(job, d, finished)
            yield msg
        self.core.m.requests.inc(api="grpc", code="OK")

    @staticmethod
    def _response(job: Job, d, finished: int) -> gateway_pb2.GenerateResponse:
        """One delta as a GenerateResponse; `finished`: choices ended so far, this one included."""
        msg = gateway_pb2.GenerateResponse(request_id=job.request_id, token_ids=d.token_ids, text=d.text,
                                           finish_reason=FINISH_TO_PROTO[d.finish_reason], index=d.index)
        if d.timings is not None:
            timings_to_proto(d.timings, msg.timings)
        for lp in d.logprobs:
            lp.to_proto(msg.logprobs.add())
        if ended(finished, job.sampling.n):  # the last choice's end: usage summed over the choices
            msg.usage.prompt_tokens, msg.usage.completion_tokens = d.prompt_tokens, d.completion_tokens
            msg.usage.cached_tokens, msg.usage.migrations = d.cached_tokens, d.migrations
        return msg

    @grpc_errors
    async def ListModels(self, request, context):
        a = self.core.adapter
        info = gateway_pb2.ModelInfo(id=self.core.cfg.served_model, family=a.family, modalities=list(a.modalities),
                                     max_model_len=self.core.max_model_len, created=self.core.started)
        return gateway_pb2.ListModelsResponse(models=[info])
