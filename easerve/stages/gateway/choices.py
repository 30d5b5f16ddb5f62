"""The gateway's token streams: the `Delta`s it yields, decode's chunks as it reads them,
and the fan-in of a request with n > 1 choices (`SamplingParams.n`).

n choices cost one encode and one prefill: prefill samples every choice's first token (choice
i with `SamplingParams.choice(i)`: seed + i) and sends one first-token chunk per choice, then
hands the KV to decode once; decode forks the request into n sequences sharing the prompt's
KV and streams chunks tagged with their choice (`TokenChunk.index`). `fan_in` turns that into
deltas tagged with `index`: each choice ends with one delta carrying its finish_reason (a
choice prefill ended is not reported again), and the delta that ends the last choice carries
the usage (prompt tokens once, completion tokens summed over the choices). A consumer knows
the request is over after n finish reasons (`ended`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from easerve.engine.logprobs import TokenLogprobs
from easerve.errors import DecodeStalled, Unavailable
from easerve.rpc.errors import from_rpc_error
from easerve.types import Timings
from easerve.wire.protoconv import FINISH_FROM_PROTO


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set once per choice, on its last delta
    prompt_tokens: int = 0
    completion_tokens: int = 0      # on the request's last delta: summed over its choices
    timings: Timings | None = None  # on the first delta and the last one
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token id, when asked for
    cached_tokens: int = 0          # on the last delta: prompt tokens prefill's prefix cache answered
    index: int = 0                  # the choice (sampling n > 1) this delta belongs to
    migrations: int = 0             # on the last delta: times the stream moved to another decode instance


def ended(finished: int, n: int) -> bool:
    """Whether a request of n choices is over once `finished` of its deltas carried a finish reason."""
    return finished >= n


def chunk_logprobs(chunk) -> list[TokenLogprobs]:
    return [TokenLogprobs.from_proto(m) for m in chunk.logprobs]


async def drain(call) -> None:
    """Wait for the end of a call whose useful messages were already read (the handoff's
    success); its failure becomes the matching domain error."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None


async def decode_chunks(dcall, tail: asyncio.Future, addr: str, got: int,
                        progress_s: float | None = None) -> AsyncIterator:
    """Decode's chunks, failing at once if the upstream call (`tail`: the KV handoff) fails;
    a failure of the stream names the decode instance and how far the request got (`got`:
    tokens before the first chunk). No chunk for `progress_s` seconds: DecodeStalled."""
    loop = asyncio.get_running_loop()
    while True:
        if tail.done() and not tail.cancelled() and tail.exception() is None:  # the usual case, per token:
            chunk = await _read_within(dcall, progress_s, addr, got)       # no task, no wait set
            got += len(chunk.token_ids)
            yield chunk
            continue
        read = asyncio.ensure_future(dcall.read())
        until = None if progress_s is None else loop.time() + progress_s
        waits = {read} if tail.done() else {read, tail}
        try:
            done, _ = await asyncio.wait(waits, timeout=progress_s, return_when=asyncio.FIRST_COMPLETED)
            if tail in done and tail.exception() is not None:
                raise tail.exception()
            if read not in done and tail in done:
                done, _ = await asyncio.wait({read}, timeout=None if until is None else max(0.0, until - loop.time()))
            if read not in done:
                raise DecodeStalled(f"decode instance {addr} sent no token for {progress_s:g} s after {got} token(s)")
        except BaseException:
            read.cancel()
            raise
        try:
            chunk = _token_chunk(read.result(), addr, got)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e).where(f"decode instance {addr} after {got} token(s)") from None
        got += len(chunk.token_ids)
        yield chunk


async def _read_within(dcall, progress_s: float | None, addr: str, got: int):
    """decode_chunks' next chunk once the handoff succeeded: one timer for the progress deadline
    (asyncio.timeout) instead of a task and a wait set per token."""
    try:
        if progress_s is None:
            chunk = await dcall.read()
        else:
            async with asyncio.timeout(progress_s):
                chunk = await dcall.read()
    except TimeoutError:
        raise DecodeStalled(f"decode instance {addr} sent no token for {progress_s:g} s after {got} token(s)") from None
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e).where(f"decode instance {addr} after {got} token(s)") from None
    return _token_chunk(chunk, addr, got)


def _token_chunk(chunk, addr: str, got: int):
    if chunk is grpc.aio.EOF:
        raise Unavailable(f"decode instance {addr} closed the stream after {got} token(s), "
                          "before the request finished")
    return chunk


async def _first_chunks(first, ucall, n: int) -> list:
    """The n first-token chunks of prefill (`first` already read from `ucall`), one per choice."""
    chunks = [first]
    try:
        while len(chunks) < n:
            msg = await ucall.read()
            if msg is grpc.aio.EOF:
                raise Unavailable(f"prefill ended its stream after {len(chunks)} of {n} choices' first tokens")
            chunks.append(msg)
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None
    if sorted(c.index for c in chunks) != list(range(n)):
        raise Unavailable(f"prefill sent first tokens for choices {sorted(c.index for c in chunks)}, not 0..{n - 1}")
    return chunks


async def fan_in(core, job, prompt, first, ucall, dcall, addr: str) -> AsyncIterator[Delta]:
    """The deltas of a request with n > 1 choices (see the module doc). `core`: the
    GatewayCore (its metrics and bookkeeping); `first`: prefill's first chunk, read from
    `ucall`; `dcall`: decode's Open stream at `addr`."""
    n = job.sampling.n
    timings = core._first_timings(job, first)
    counts, finished = [1] * n, {}
    state = {"first_at": None}

    def delta(chunk, finish: str | None, t: Timings | None) -> Delta:
        c = chunk.index
        if finish is not None:
            finished[c] = finish
        if finish is None or not ended(len(finished), n):
            return Delta(list(chunk.token_ids), chunk.text, finish, timings=t, logprobs=chunk_logprobs(chunk), index=c)
        last = core._last(job, prompt, chunk, finish, sum(counts), state["first_at"], t or Timings(), max(counts))
        return replace(last, index=c)

    for chunk in await _first_chunks(first, ucall, n):
        d = delta(chunk, FINISH_FROM_PROTO[chunk.finish_reason], timings if chunk.index == 0 else None)
        yield d
        if ended(len(finished), n):
            return
    tail = asyncio.ensure_future(drain(ucall))
    state["first_at"] = time.monotonic()
    try:
        async for chunk in decode_chunks(dcall, tail, addr, n):
            c = chunk.index
            if c >= n or c in finished:
                continue  # a choice prefill ended: decode reports it too
            counts[c] += len(chunk.token_ids)
            finish = FINISH_FROM_PROTO[chunk.finish_reason]
            t = None if finish is None else Timings(kv_transfer_ms=chunk.timings.kv_transfer_ms)
            yield delta(chunk, finish, t)
            if ended(len(finished), n):
                return
    finally:
        if not tail.done():
            tail.cancel()
