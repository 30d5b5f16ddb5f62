"""Proto messages <-> domain objects, in one place (servicers stay thin).

Tensors, sampling parameters, media items and token chunks; the KV / tensor *wire format*
that transports move (typed header + raw bytes) is `easerve.wire.codec`.
"""
from __future__ import annotations

import torch

from easerve.wire.codec import parse_spec, raw_bytes, view_tensor, spec_of
from easerve.errors import CodecError, InvalidRequest
from easerve.wire.sampling_proto import sampling_from_proto
from easerve.types import ItemMeta, MMItem, PrefillRequest
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import encode_pb2 as epb


def tensor_to_proto(t: torch.Tensor) -> cpb.TensorProto:
    s = spec_of(t)
    data = memoryview(raw_bytes(t).numpy()).tobytes() if s.nbytes else b""
    return cpb.TensorProto(dtype=s.dtype, shape=list(s.shape), data=data)


def tensor_from_proto(msg, *, copy: bool = True) -> torch.Tensor:
    s = parse_spec(0, {"dtype": msg.dtype, "shape": list(msg.shape)})
    if len(msg.data) != s.nbytes:
        raise CodecError(f"TensorProto {s.dtype}{list(s.shape)} needs {s.nbytes} bytes, has {len(msg.data)}")
    return view_tensor(memoryview(msg.data), s, 0, copy)


FINISH_TO_PROTO = {
    None: cpb.FINISH_REASON_UNSPECIFIED,
    "stop": cpb.FINISH_REASON_STOP,
    "length": cpb.FINISH_REASON_LENGTH,
    "abort": cpb.FINISH_REASON_CANCELLED,
    "cancelled": cpb.FINISH_REASON_CANCELLED,
    "error": cpb.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO = {
    cpb.FINISH_REASON_UNSPECIFIED: None,
    cpb.FINISH_REASON_STOP: "stop",
    cpb.FINISH_REASON_LENGTH: "length",
    cpb.FINISH_REASON_CANCELLED: "cancelled",
    cpb.FINISH_REASON_ERROR: "error",
}


def _tensors_to_proto(d: dict) -> dict:
    return {k: tensor_to_proto(v) for k, v in d.items()}


def _tensors_from_proto(d) -> dict:
    return {k: tensor_from_proto(v) for k, v in d.items()}


def item_meta_to_proto(modality: str, num_tokens: int, meta: dict, content_hash: bytes = b"") -> cpb.ItemMeta:
    return cpb.ItemMeta(modality=modality, num_tokens=num_tokens, meta=_tensors_to_proto(meta),
                        content_hash=content_hash)


def item_meta_from_proto(m: cpb.ItemMeta) -> tuple[str, int, dict]:
    return m.modality, m.num_tokens, _tensors_from_proto(m.meta)


def media_item_to_proto(item: MMItem, *, with_inputs: bool = True) -> epb.MediaItem:
    """`with_inputs=False` leaves the heavy inputs out (the encoder cache holds the item)."""
    return epb.MediaItem(info=item_meta_to_proto(item.modality, item.num_tokens, item.meta),
                         inputs=_tensors_to_proto(item.pixels) if with_inputs else {},
                         content_hash=item.content_hash)


def media_item_from_proto(m: epb.MediaItem) -> MMItem:
    modality, num_tokens, meta = item_meta_from_proto(m.info)
    return MMItem(modality=modality, pixels=_tensors_from_proto(m.inputs), meta=meta, num_tokens=num_tokens,
                  content_hash=bytes(m.content_hash))


def token_chunk(request_id: str, token_ids, finish_reason: str | None = None, text: str = "",
                usage: tuple[int, int] | None = None, logprobs=(), cached_tokens: int = 0, index: int = 0,
                **timings: float) -> cpb.TokenChunk:
    """`logprobs`: one easerve.engine.logprobs.TokenLogprobs per token id (or none at all);
    `cached_tokens` (prefill's first chunk): prompt tokens the prefix cache answered;
    `index`: the choice (sampling n > 1) the tokens belong to."""
    chunk = cpb.TokenChunk(request_id=request_id, token_ids=list(token_ids), text=text,
                           finish_reason=FINISH_TO_PROTO[finish_reason], index=index)
    for lp in logprobs:
        lp.to_proto(chunk.logprobs.add())
    if usage is not None:
        chunk.usage.prompt_tokens, chunk.usage.completion_tokens = usage
    if cached_tokens:
        chunk.usage.cached_tokens = cached_tokens
    for k, v in timings.items():
        setattr(chunk.timings, k, v)
    return chunk


def prefill_request_from_proto(msg, embeds: list[torch.Tensor] | None = None) -> PrefillRequest:
    """easerve.v1.PrefillRequest -> the domain request: one embedding per item, `embeds` (taken
    from the transport `embeddings_transfer` names) or else the inline tensors."""
    items = [item_meta_from_proto(m) for m in msg.items]
    hashes = [bytes(m.content_hash) for m in msg.items]
    if embeds is None:
        embeds = [tensor_from_proto(t) for t in msg.embeddings.tensors]
    if len(embeds) != len(items):
        raise InvalidRequest(f"{len(items)} media items but {len(embeds)} embedding tensors; send one per item")
    if not msg.meta.request_id:
        raise InvalidRequest("meta.request_id is required")
    return PrefillRequest(msg.meta.request_id, list(msg.input_ids), embeds,
                          [ItemMeta(mod, meta, h) for (mod, _n, meta), h in zip(items, hashes)], sampling_from_proto(msg.sampling))
