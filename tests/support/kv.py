"""A small random KV payload and a send / receive round trip through a KV transport."""
from __future__ import annotations

import torch

from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.types import KVPayload, SamplingParams
from easerve.wire import codec
from easerve.wire.v1 import kv_pb2


def kv(tokens=5, layers=3, dtype=torch.bfloat16, rid="r1") -> KVPayload:
    g = torch.Generator().manual_seed(1)
    mk = lambda: torch.randn(2, tokens, 8, generator=g).to(dtype)  # noqa: E731
    return KVPayload(rid, [mk() for _ in range(layers)], [mk() for _ in range(layers)],
                     prompt_len=tokens, rope_delta=0, first_token=3, sampling=SamplingParams())


async def roundtrip(tx, rx, payload, through_proto=True):
    handle = await tx.send(payload.request_id, *codec.kv_to_parts(payload))
    if through_proto:
        handle = handle_from_proto(kv_pb2.KVTransfer.FromString(handle_to_proto(handle).SerializeToString()))
    return handle, codec.kv_from_parts(*await rx.recv(handle))
