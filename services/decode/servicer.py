"""easerve.v1.Decode <-> the async engine front (thin)."""
from __future__ import annotations

from easerve.engine.errors import Overloaded as EngineFull
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import Overloaded, grpc_errors
from easerve.stages.convert import token_chunk
from easerve.v1 import decode_pb2, decode_pb2_grpc


MAX_HOLD_S = 120.0  # a reservation lapses at the request's deadline, at the latest after this


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine, kv_receiver, max_waiting: int):
        self.engine, self.kv, self.max_waiting = engine, kv_receiver, max_waiting

    @grpc_errors
    async def Decode(self, request, context):
        payload = await self.kv.fetch(request.kv)
        n = 1
        try:
            async for o in self.engine.generate(payload):
                if o.index == 0 and not o.finished:
                    continue  # prefill already sent the first token
                ids = [o.token_id] if o.token_id is not None and o.index > 0 else []
                n = max(n, o.index + 1)
                usage = (payload.prompt_len, n) if o.finished else None
                yield token_chunk(payload.request_id, ids, o.finish_reason if o.finished else None,
                                  text=o.text_delta, usage=usage)
        except EngineFull as e:
            raise Overloaded(str(e)) from None

    @grpc_errors
    async def Reserve(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        ttl = min(deadline.remaining(), MAX_HOLD_S)
        try:
            await self.engine.reserve(request.meta.request_id, request.num_tokens, request.max_new_tokens, ttl)
        except EngineFull as e:
            raise Overloaded(str(e)) from None
        return decode_pb2.ReserveResponse()

    @grpc_errors
    async def Stats(self, request, context):
        s = await self.engine.stats()
        return decode_pb2.StatsResponse(running=s.running, waiting=s.waiting, max_waiting=self.max_waiting,
                                        kv_free_tokens=s.kv_free_tokens, kv_total_tokens=s.kv_capacity_tokens,
                                        kv_free_bytes=int(s.kv_bytes * s.kv_free_tokens / max(1, s.kv_capacity_tokens)))

    @grpc_errors
    async def Cancel(self, request, context):
        return decode_pb2.CancelResponse(found=await self.engine.abort(request.request_id))
