"""easerve.v1.Prefill <-> PrefillStage (thin)."""
from __future__ import annotations

from easerve.codec import sampling_from_proto, tensor_from_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import InvalidRequest, grpc_errors
from easerve.stages.convert import item_meta_from_proto
from easerve.types import PrefillRequest
from easerve.v1 import prefill_pb2_grpc


async def request_from_proto(msg, embeddings_receiver=None) -> PrefillRequest:
    items = [item_meta_from_proto(m) for m in msg.items]
    src = msg.WhichOneof("embeddings_source")
    if src == "embeddings":
        embeds = [tensor_from_proto(t) for t in msg.embeddings.tensors]
    elif src == "embeddings_handle":
        if embeddings_receiver is None:
            raise InvalidRequest("this prefill worker takes embeddings inline only")
        embeds = await embeddings_receiver.fetch_tensors(msg.embeddings_handle)
    else:
        embeds = []
    if len(embeds) != len(items):
        raise InvalidRequest(f"{len(items)} media items but {len(embeds)} embedding tensors; send one per item")
    if not msg.meta.request_id:
        raise InvalidRequest("meta.request_id is required")
    return PrefillRequest(msg.meta.request_id, list(msg.input_ids), embeds,
                          [(mod, meta) for mod, _n, meta in items], sampling_from_proto(msg.sampling))


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, stage, embeddings_receiver=None):
        self.stage, self.receiver = stage, embeddings_receiver

    @grpc_errors
    async def Prefill(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        req = await request_from_proto(request, self.receiver)
        async for chunk in self.stage.run(req, deadline):
            yield chunk
