"""Inline: the whole codec frame travels inside the handle (small payloads, tests, and the
embeddings' fallback where no other transport reaches); large frames are built off the loop."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from easerve.wire import codec
from easerve.transport.base import KVTransport, off_loop, tensor_bytes
from easerve.transport.handles import Handle, InlineHandle


class InlineTransport(KVTransport):
    name = "inline"

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> InlineHandle:
        t0 = time.perf_counter()
        h = InlineHandle(request_id, await off_loop(tensor_bytes(tensors), codec.join_parts, header, tensors))
        self._measured(h.nbytes, t0)
        return h

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, InlineHandle)
        t0 = time.perf_counter()
        out = await off_loop(handle.nbytes, codec.split_parts, handle.data)
        self._measured(handle.nbytes, t0)
        return out
