"""easerve.v1.Prefill <-> PrefillStage (thin)."""
from __future__ import annotations

import asyncio
import time

from easerve.wire.protoconv import prefill_request_from_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import grpc_errors
from easerve.wire.v1 import prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, stage):
        self.stage = stage

    @grpc_errors
    async def Prefill(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        slo = Deadline.from_ms(request.meta.slo_ttft_ms)  # its first token's due time by its SLO tier
        t0 = time.monotonic()
        req = await asyncio.to_thread(prefill_request_from_proto, request)  # tensor copies: off the loop
        timings = {"embed_transfer_ms": (time.monotonic() - t0) * 1000} if req.embeddings else {}
        async for chunk in self.stage.run(req, request.decode.address, deadline, slo, request.meta.yields,
                                        **timings):
            yield chunk
