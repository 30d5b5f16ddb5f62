"""Prefill as a stage: batch-prefill, send the first token up at once, hand the KV to the
decode instance that holds the request's reservation, and let go.

Used by the prefill service and by the encode service's co-located prefill, so a local
and a remote prefill behave exactly alike downstream. The stream `run()` yields carries
one chunk per choice (sampling n: the choice's first token, its text, and its finish reason
when it ends right there; the KV goes to decode once, with every choice's first token) and
ends once decode has the KV: the tokens after the first go from decode
straight to the gateway, so prefill holds nothing for a request that is decoding.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from easerve.engine.detok import prompt_tail
from easerve.engine.logit_transforms import penalty_prompt_ids
from easerve.engine.logprobs import token_logprobs
from easerve.engine.stops import StopRules
from easerve.policy.clock import Clock, MonotonicClock
from easerve.wire.protoconv import token_chunk
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import from_peer_error
from easerve.errors import InvalidRequest, Unavailable
from easerve.stages.common.limits import InflightLimit
from easerve.stages.common.peers import READY_S, Peers, peers_of
from easerve.stages.prefill.loop import PrefillLoop
from easerve.transport.handoff import KVSenders
from easerve.types import KVPayload, PrefillRequest
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import decode_pb2

class PrefillStage:
    def __init__(self, loop: PrefillLoop, decode: Peers, senders: KVSenders, eos_ids, tokenizer,
                 max_inflight: int = 512, metrics=None):
        """`decode`: the instances this prefill may hand KV to (requests name one of them);
        `metrics`: an easerve.stages.common.metrics.PrefillMetrics (or None)."""
        self.loop, self.decode, self.senders = loop, decode, senders
        self.eos, self.tokenizer, self.m = tuple(eos_ids), tokenizer, metrics
        self.limit = InflightLimit(max_inflight, "prefill")
        self.local_submit = None  # a monolith: every KV goes to this process's own engine

    def decode_in_process(self, submit) -> None:
        """Hand every KV to `await submit(payload)` (this process's engine), no transport:
        the monolith, whose reservations the gateway always makes on this very process."""
        self.local_submit = submit

    def start(self) -> None:
        self.loop.start()
        self.decode.start()

    async def stop(self) -> None:
        await self.loop.stop()
        await self.decode.close()
        await self.senders.close()

    async def _target(self, addr: str):
        """The decode peer at `addr`. No address: INVALID_ARGUMENT. An address this prefill does
        not have (after looking the list up again): UNAVAILABLE, since that is an instance
        drained or removed after the caller chose it (the caller retries with another)."""
        if not addr:
            raise InvalidRequest("the prefill request names no decode target; set PrefillRequest.decode.address")
        peer = await self.decode.lookup(addr)
        if peer is None:
            raise Unavailable(f"decode target {addr!r} is not one of this prefill's decode instances "
                              f"({', '.join(self.decode.addrs)}): drained or removed; retry with another")
        return peer

    async def run(self, req: PrefillRequest, target: str, deadline: Deadline, slo: Deadline | None = None,
                  yields: bool = False, **timings: float) -> AsyncIterator[cpb.TokenChunk]:
        """Yield the first-token chunk; return once the KV is at `target` (a decode address).
        `slo`: when the first token is due by the request's SLO tier, `yields`: best-effort or
        batch work (RequestMeta.slo_ttft_ms / yields; the planner's deadline order)."""
        with self.limit.admit():
            peer = None if self.local_submit is not None else await self._target(target)
            if peer is not None:
                peer.outstanding += 1  # its channel stays open while this request needs it
            try:
                async for chunk in self._run(req, peer, deadline, slo, yields, timings):
                    yield chunk
            finally:
                if peer is not None:
                    self.decode.finish(peer)

    async def _run(self, req: PrefillRequest, peer, deadline: Deadline, slo: Deadline | None, yields: bool,
                   timings: dict) -> AsyncIterator[cpb.TokenChunk]:
        slo_s = slo.remaining() if slo is not None and slo.bounded else None
        one = await self.loop.prefill(req, slo_s, yields)
        deadline.check("prefill")
        if self.m is not None:
            self.m.on_request(one.batch_size, one.result.prompt_len)
            if self.loop.prefix is not None:
                self.m.on_prefix_cache(one.result.prompt_len, one.result.cached_tokens)
        sp, live = req.sampling, False
        prompt = sp.prompt_ids(req.input_ids)  # a resumed request's earlier tokens replay from `sp`
        tail = prompt_tail(prompt)
        for i, tok in enumerate(one.first_tokens):  # a chunk per choice; the first carries the timings
            verdict = StopRules(sp.choice(i), self.eos, self.tokenizer, tail).push(tok)
            live = live or not verdict.finished
            lps = [lp for lp in token_logprobs(one.result.last_logits[None], [tok], [sp.logprobs]) if lp is not None]
            extra = dict(cached_tokens=one.result.cached_tokens, prefill_ms=one.prefill_ms, **timings) if i == 0 else {}
            yield token_chunk(req.request_id, [tok], verdict.finish_reason, text=verdict.text, index=i,
                              usage=(one.result.prompt_len, 1) if verdict.finished else None, logprobs=lps, **extra)
        if not live:
            return  # the gateway ends its reservation at decode
        r = one.result
        payload = KVPayload(req.request_id, r.keys, r.values, r.prompt_len, r.rope_delta, one.first_token,
                            sp, prompt_ids_tail=tail, penalty_ids=penalty_prompt_ids(sp, prompt),
                            first_tokens=list(one.first_tokens) if sp.n > 1 else [])
        await self._handoff(peer, payload, deadline)

    async def _handoff(self, peer, payload: KVPayload, deadline: Deadline) -> None:
        t0 = time.monotonic()
        if peer is None:
            await self.local_submit(payload)
            if self.m is not None:
                self.m.on_kv_handoff("in_process", time.monotonic() - t0)
            return
        wait = min(READY_S, deadline.timeout() or READY_S)
        if not await self.decode.connected(peer.addr, wait):  # first contact: not a channel still backing off
            raise Unavailable(f"decode instance {peer.addr} unreachable: not connected within {wait:.1f} s")
        msg, transport = await self.senders.send(peer.addr, payload, timeout=deadline.timeout())
        meta = cpb.RequestMeta(request_id=payload.request_id, deadline_ms=deadline.to_ms())
        try:
            await peer.stub.Submit(decode_pb2.DecodeRequest(meta=meta, kv=msg), timeout=deadline.timeout())
        except grpc.aio.AioRpcError as e:
            raise from_peer_error(e) from None
        finally:
            self.senders.release(transport, msg)
        if self.m is not None:
            self.m.on_kv_handoff(transport.name, time.monotonic() - t0)


def build_prefill_stage(cfg, adapter, channel_options, node, *, executor=None, scope=None, on_busy=None,
                        metrics=None, clock: Clock | None = None) -> PrefillStage:
    """The prefill stage of a process from its config (a PrefillFields config): batched loop
    (reading `clock`, a MonotonicClock unless given) with its prefix cache (unless
    --no-prefix-cache), decode peers (polled for load and node identity), KV senders chosen per peer."""
    from easerve.cache.prefix_kv import PrefixKV
    from easerve.policy.prefill_plan import PrefillBatchConfig
    from easerve.wire.v1 import decode_pb2_grpc

    from easerve.rpc.tls import tls_of

    tls = tls_of(cfg)
    decode = peers_of(cfg, "decode", decode_pb2_grpc.DecodeStub, channel_options, "easerve.v1.Decode",
                      on_closed=lambda addr: senders.forget(addr), tls=tls)  # forget: a removed decode instance
    senders = KVSenders(node, decode.reach_of, cfg.kv_transport, channel_options, tls=tls)
    batching = PrefillBatchConfig(max_batched_tokens=cfg.max_batched_tokens, max_batch_size=cfg.max_prefill_batch)
    prefix = PrefixKV.for_adapter(adapter, cfg.prefix_cache) if cfg.prefix_cache is not None else None
    loop = PrefillLoop(adapter, batching, executor=executor, scope=scope, on_busy=on_busy,
                       clock=clock or MonotonicClock(), prefix=prefix)
    return PrefillStage(loop, decode, senders, adapter.eos_token_ids, adapter.tokenizer, cfg.max_inflight,
                        metrics=metrics)
