"""easerve.v1.Encode: batch-encode, route to co-located or remote prefill, relay tokens."""
from __future__ import annotations


from easerve.codec import sampling_from_proto, tensor_to_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import InvalidRequest, grpc_errors
from easerve.stages.convert import item_meta_to_proto, media_item_from_proto
from easerve.stages.limits import InflightLimit
from easerve.stages.peers import Peers, relay
from easerve.types import PrefillRequest
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import encode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


class EncodeServicer(encode_pb2_grpc.EncodeServicer):
    def __init__(self, loop, router, local_stage=None, prefill_addrs: tuple[str, ...] = (),
                 channel_options=(), metrics=None, max_inflight: int = 512):
        if local_stage is None and not prefill_addrs:
            raise ValueError("encode needs a co-located prefill (--colocate-prefill) or --prefill addresses")
        self.loop, self.router, self.local, self.m = loop, router, local_stage, metrics
        self._remote = Peers(prefill_pb2_grpc.PrefillStub, prefill_addrs, channel_options)
        self.limit = InflightLimit(max_inflight, "encode")

    def _route(self) -> str:
        if self.local is None:
            return "remote"
        if not self._remote:
            return "local"
        return self.router.route()

    @grpc_errors
    async def Encode(self, request, context):
        with self.limit.admit():
            async for chunk in self._encode(request, context):
                yield chunk

    async def _encode(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        rid = request.meta.request_id
        if not rid:
            raise InvalidRequest("meta.request_id is required")
        items = [media_item_from_proto(m) for m in request.items]
        if not items:
            raise InvalidRequest("an encode request needs at least one media item; send text-only requests to prefill")
        sampling = sampling_from_proto(request.sampling)
        res = await self.loop.encode(rid, items)
        deadline.check("encode")
        route = self._route()
        if self.m is not None:
            self.m.on_route(route, self.router)
        timings = {"encode_ms": res.encode_ms, "queue_ms": res.queue_ms}
        if route == "local":
            req = PrefillRequest(rid, list(request.input_ids), res.embeddings,
                                 [(it.modality, it.meta) for it in items], sampling)
            async for chunk in self.local.run(req, deadline, **timings):
                yield chunk
            return
        async for chunk in self._remote_prefill(request, items, res, deadline, timings):
            yield chunk

    async def _remote_prefill(self, request, items, res, deadline: Deadline, timings: dict):
        msg = prefill_pb2.PrefillRequest(
            meta=cpb.RequestMeta(request_id=request.meta.request_id, deadline_ms=deadline.to_ms(),
                                 model=request.meta.model),
            input_ids=request.input_ids, sampling=request.sampling,
            items=[item_meta_to_proto(it.modality, it.num_tokens, it.meta) for it in items],
            embeddings=prefill_pb2.Embeddings(tensors=[tensor_to_proto(e) for e in res.embeddings]))
        first = True
        async for chunk in relay(self._remote.next().Prefill(msg, timeout=deadline.timeout())):
            if first:
                first = False
                for k, v in timings.items():
                    setattr(chunk.timings, k, v)
            yield chunk
