"""Talking to the next stage: its workers' stubs picked round robin, and the relay of
a server-streaming call (downstream status -> domain error, call cancelled on exit)."""
from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence

import grpc

from easerve.rpc.errors import from_rpc_error


class Peers:
    """One stub per worker address of a downstream stage; `next()` picks round robin."""

    def __init__(self, stub_cls, addrs: Sequence[str], channel_options=()):
        self._stubs = [stub_cls(grpc.aio.insecure_channel(a, options=list(channel_options))) for a in addrs]
        self._rr = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._stubs)

    def next(self):
        return self._stubs[next(self._rr) % len(self._stubs)]


async def relay(call) -> AsyncIterator:
    """Yield a streaming call's messages; its failure becomes the matching domain error,
    and leaving early (client cancel, deadline) cancels it downstream."""
    try:
        async for msg in call:
            yield msg
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None
    finally:
        call.cancel()
