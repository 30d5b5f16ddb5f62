"""easerve.v1.Encode: batch-encode (through the encoder cache when on), route to co-located
or remote prefill (thin). Embeddings reach a remote prefill through the KV transports
(`embed`, a transport.handoff.KVSenders: shared memory on one host, CUDA IPC on one GPU): the
message carries a handle, the bytes only where no transport reaches (inline); what the
transport holds is let go once the call ends, however it ends.

The call's stream carries the first token and ends once prefill has handed the KV to
decode; encode holds nothing for a request that is decoding.
"""
from __future__ import annotations

import asyncio
import functools
import time

from easerve.wire.codec import embeddings_to_parts
from easerve.wire.protoconv import item_meta_to_proto, media_item_from_proto
from easerve.wire.sampling_proto import sampling_from_proto
from easerve.rpc.deadline import Deadline
from easerve.errors import CacheMiss, InvalidRequest
from easerve.rpc.errors import grpc_errors
from easerve.stages.common.limits import InflightLimit
from easerve.stages.common.peers import Peers, relay
from easerve.transport.handoff import KVSenders
from easerve.types import PrefillRequest, items_meta
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import encode_pb2, encode_pb2_grpc, prefill_pb2
from easerve.cache.embeddings import CachedEncode, EmbeddingCache
from easerve.cache.prefix_route import PrefixRoute, up_loads


class EncodeServicer(encode_pb2_grpc.EncodeServicer):
    def __init__(self, loop, router, local_stage=None, remote: Peers | None = None, metrics=None,
                 max_inflight: int = 512, cache: EmbeddingCache | None = None, route: PrefixRoute | None = None,
                 embed: KVSenders | None = None):
        """`route`: prefix-cache placement among the remote prefill instances (None: least loaded);
        `embed`: the embedding senders to the remote prefill instances (needed with `remote`)."""
        if local_stage is None and not remote:
            raise ValueError("encode needs a co-located prefill (--colocate-prefill) or --prefill addresses")
        if remote and embed is None:
            raise ValueError("remote prefill instances need embedding senders (embed=KVSenders(...))")
        self.loop, self.router, self.local, self.remote, self.m = loop, router, local_stage, remote, metrics
        self.embed = embed
        self.limit = InflightLimit(max_inflight, "encode")
        self.cache, self.route = cache, route
        self.online = None  # an easerve.stages.encode.online.OnlineTask with --online: told of each arrival

    @grpc_errors
    async def Holds(self, request, context):
        hashes = list(request.content_hashes)
        held = self.cache.holds(hashes) if self.cache is not None else [False] * len(hashes)
        return encode_pb2.HoldsResponse(held=held)

    async def _embed(self, rid: str, items, meta=None) -> CachedEncode:
        slo_s = meta.slo_ttft_ms / 1000.0 if meta is not None and meta.slo_ttft_ms else None
        encode = functools.partial(self.loop.encode, slo_s=slo_s, yields=bool(meta is not None and meta.yields))
        if self.cache is not None:
            return await self.cache.encode(rid, items, encode)
        for i, it in enumerate(items):
            if not it.pixels:
                raise CacheMiss.of_item(i, it.modality, "came without inputs and this instance has no "
                                        "encoder cache (--encoder-cache-gb 0)")
        res = await encode(rid, items)
        return CachedEncode(res.embeddings, res.queue_ms, res.encode_ms, 0)

    def _route(self) -> str:
        if self.local is None:
            return "remote"
        if not self.remote:
            return "local"
        return self.router.route()

    @grpc_errors
    async def Encode(self, request, context):
        with self.limit.admit():
            async for chunk in self._encode(request, context):
                yield chunk

    async def _encode(self, request, context):
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        slo = Deadline.from_ms(request.meta.slo_ttft_ms)  # its first token's due time by its SLO tier
        rid = request.meta.request_id
        if not rid:
            raise InvalidRequest("meta.request_id is required")
        items = await asyncio.to_thread(lambda: [media_item_from_proto(m) for m in request.items])
        if not items:
            raise InvalidRequest("an encode request needs at least one media item; send text-only requests to prefill")
        if self.online is not None:
            self.online.arrival(items[0].modality)
        sampling = sampling_from_proto(request.sampling)
        res = await self._embed(rid, items, request.meta)
        deadline.check("encode")
        route = self._route()
        if self.m is not None:
            self.m.on_route(route)
        timings = {"encode_ms": res.encode_ms, "queue_ms": res.queue_ms, "encode_cache_hits": res.hits}
        if route == "local":
            req = PrefillRequest(rid, list(request.input_ids), res.embeddings,
                                 items_meta(items), sampling)
            async for chunk in self.local.run(req, request.decode.address, deadline, slo, request.meta.yields,
                                              **timings):
                yield chunk
            return
        async for chunk in self._remote_prefill(request, items, res, deadline, slo, timings):
            yield chunk

    async def _remote_prefill(self, request, items, res, deadline: Deadline, slo: Deadline, timings: dict):
        rid = request.meta.request_id
        base = prefill_pb2.PrefillRequest(
            meta=cpb.RequestMeta(request_id=rid, deadline_ms=deadline.to_ms(),
                                 model=request.meta.model, slo_ttft_ms=slo.to_ms(), yields=request.meta.yields),
            input_ids=request.input_ids, sampling=request.sampling, decode=request.decode,
            items=[item_meta_to_proto(it.modality, it.num_tokens, it.meta, it.content_hash) for it in items])
        header, tensors = embeddings_to_parts(rid, res.embeddings)
        sent: list = []  # (transport, message) per instance tried: each let go of when the call ends
        send_ms = 0.0

        async def open_call(p):  # the embeddings go to the instance the call goes to
            nonlocal send_ms
            t0 = time.monotonic()
            transfer, transport = await self.embed.send_parts(p.addr, rid, header, tensors, deadline.timeout())
            sent.append((transport, transfer))
            send_ms += (time.monotonic() - t0) * 1000
            msg = prefill_pb2.PrefillRequest()
            msg.CopyFrom(base)
            msg.embeddings_transfer.CopyFrom(transfer)
            return p.stub.Prefill(msg, timeout=deadline.timeout())

        hashes = self.route.hashes(list(request.input_ids), [(it.modality, it.num_tokens, it.content_hash)
                                                            for it in items]) if self.route else []
        try:
            peer, call, first = await self.remote.start_call(
                open_call, prefer=self.route.prefer(hashes, up_loads(self.remote)) if self.route else None)
            if self.route:
                self.route.sent(hashes, peer.addr)
            try:
                for k, v in timings.items():
                    setattr(first.timings, k, v)
                first.timings.embed_transfer_ms += send_ms
                yield first
                async for chunk in relay(call):
                    yield chunk
            finally:
                self.remote.finish(peer)
        finally:
            for transport, transfer in sent:
                self.embed.release(transport, transfer)
