"""easerve.v1.Prefill <-> PrefillStage (thin). Embeddings come inline in the message or
through a transport (`embeddings_transfer`: a handle `receiver` fetches; shared memory is
viewed in place), counted by transport in the receiver."""
from __future__ import annotations

import asyncio
import time

from easerve.errors import InvalidRequest
from easerve.transport.handoff import KVReceiver
from easerve.wire.codec import embeddings_from_parts
from easerve.wire.protoconv import prefill_request_from_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import grpc_errors
from easerve.wire.v1 import prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, stage, receiver: KVReceiver):
        self.stage, self.receiver = stage, receiver

    @grpc_errors
    async def Prefill(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        slo = Deadline.from_ms(request.meta.slo_ttft_ms)  # its first token's due time by its SLO tier
        t0 = time.monotonic()
        embeds = await self._embeddings(request, deadline)
        req = await asyncio.to_thread(prefill_request_from_proto, request, embeds)  # tensor copies: off the loop
        timings = {"embed_transfer_ms": (time.monotonic() - t0) * 1000} if req.embeddings else {}
        async for chunk in self.stage.run(req, request.decode.address, deadline, slo, request.meta.yields,
                                        **timings):
            yield chunk

    async def _embeddings(self, request, deadline: Deadline):
        """The embeddings a transport holds for this request (None: they are inline)."""
        if not request.HasField("embeddings_transfer"):
            self.receiver.received_bytes["inline"] += sum(len(t.data) for t in request.embeddings.tensors)
            return None
        if request.embeddings.tensors:
            raise InvalidRequest("PrefillRequest sets both embeddings and embeddings_transfer; send one of them")
        header, tensors = await self.receiver.fetch_parts(request.embeddings_transfer, timeout=deadline.timeout())
        return embeddings_from_parts(header, tensors, request.meta.request_id)
