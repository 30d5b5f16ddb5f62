"""Proto messages <-> domain objects, in one place (servicers stay thin)."""
from __future__ import annotations

from easerve.codec import tensor_from_proto, tensor_to_proto
from easerve.types import MMItem
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import encode_pb2 as epb

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


def item_meta_to_proto(modality: str, num_tokens: int, meta: dict) -> cpb.ItemMeta:
    return cpb.ItemMeta(modality=modality, num_tokens=num_tokens, meta=_tensors_to_proto(meta))


def item_meta_from_proto(m: cpb.ItemMeta) -> tuple[str, int, dict]:
    return m.modality, m.num_tokens, _tensors_from_proto(m.meta)


def media_item_to_proto(item: MMItem) -> epb.MediaItem:
    return epb.MediaItem(info=item_meta_to_proto(item.modality, item.num_tokens, item.meta),
                         inputs=_tensors_to_proto(item.pixels))


def media_item_from_proto(m: epb.MediaItem) -> MMItem:
    modality, num_tokens, meta = item_meta_from_proto(m.info)
    return MMItem(modality=modality, pixels=_tensors_from_proto(m.inputs), meta=meta, num_tokens=num_tokens)


def token_chunk(request_id: str, token_ids, finish_reason: str | None = None, text: str = "",
                usage: tuple[int, int] | None = None, **timings: float) -> cpb.TokenChunk:
    chunk = cpb.TokenChunk(request_id=request_id, token_ids=list(token_ids), text=text,
                           finish_reason=FINISH_TO_PROTO[finish_reason])
    if usage is not None:
        chunk.usage.prompt_tokens, chunk.usage.completion_tokens = usage
    for k, v in timings.items():
        setattr(chunk.timings, k, v)
    return chunk
