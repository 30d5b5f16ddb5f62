"""The KVTransport interface: move a codec payload (parts header + tensors) between stages.

The sender calls `send()` and ships the returned handle (as a KVTransfer message) to the
receiver, which calls `recv(handle)`. `release(handle)` frees whatever this side still holds
for a payload that will not be (or no longer needs to be) received; it is idempotent.
The header must come from easerve.wire.codec (kv_to_parts / make_header): it describes the
tensors, so every backend can check them and rebuild them without pickle.
"""
from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from easerve.transport.handles import (CudaIpcHandle, CudaTensorRef, GrpcHandle, Handle,
                                       InlineHandle, NcclHandle, ShmHandle, handle_from_proto,
                                       handle_to_proto)

THREAD_BYTES = 1 << 20  # copies above this size run off the event loop
__all__ = ["KVTransport", "off_loop", "tensor_bytes", "Handle", "InlineHandle", "ShmHandle", "GrpcHandle", "CudaIpcHandle",
           "CudaTensorRef", "NcclHandle", "handle_to_proto", "handle_from_proto"]


class KVTransport(ABC):
    name: str = "abstract"

    def __init__(self) -> None:
        self.last_gbps: float | None = None  # GB/s (1e9 bytes/s) of the last send or recv

    @abstractmethod
    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None) -> Handle:
        """Make the payload available to a receiver; return where it is."""

    @abstractmethod
    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        """Fetch the payload a handle points to (once); the receiver owns the result."""

    @property
    def held_bytes(self) -> int:
        """Sender side: bytes still held for payloads no receiver has let go of yet."""
        return 0

    def release(self, handle: Handle) -> None:
        """Free what this side still holds for `handle` (no-op when nothing is held)."""

    async def close(self) -> None:
        """Free everything this transport still holds."""

    def _measured(self, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.last_gbps = nbytes / dt / 1e9 if dt > 0 else None

    def _expect(self, handle: Handle, kind: type) -> None:
        if not isinstance(handle, kind):
            raise ValueError(f"{self.name} transport cannot receive a {type(handle).__name__}")


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of the tensors' data (what a transport moves for them, the header aside)."""
    return sum(t.numel() * t.element_size() for t in tensors)


async def off_loop(nbytes: int, fn, *args, **kw):
    """Run fn off the event loop when it copies more than THREAD_BYTES (torch copies drop the GIL)."""
    if nbytes < THREAD_BYTES:
        return fn(*args, **kw)
    return await asyncio.to_thread(fn, *args, **kw)
