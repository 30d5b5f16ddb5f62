"""Same-node GPU transport: CUDA IPC memory handles, no trip through host memory.

Sender: records an interprocess CUDA event on the stream that wrote the tensors (`stream=`;
default: the calling thread's current stream), shares each tensor's allocation (torch.multiprocessing.reductions.reduce_tensor) and writes the fields
of that reduction into the handle one by one (never pickled). It keeps the tensors alive
until `release(handle)` or `hold_s` passes (CUDA IPC requires the producer to outlive the
consumer's use). The handle names the GPU by its UUID: the receiver maps it to its own
device index (two processes with different CUDA_VISIBLE_DEVICES number one GPU differently).
Receiver: waits on the event on its stream, maps each allocation (rebuild_cuda_tensor),
copies into its own memory, synchronises and drops the mapping.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from easerve.errors import CodecError, InvalidRequest, Unavailable
from easerve.wire import codec
from easerve.transport.base import KVTransport
from easerve.transport.handles import CudaIpcHandle, CudaTensorRef, Handle


@dataclass(frozen=True)
class CudaIpcConfig:
    hold_s: float = 120.0  # sender keeps shared tensors at most this long without a release
    device: int | None = None  # receiver: copy onto this local device index (None: the sender's GPU)

    def __post_init__(self) -> None:
        if self.hold_s <= 0:
            raise ValueError(f"hold_s must be > 0 seconds, got {self.hold_s}")


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self, config: CudaIpcConfig = CudaIpcConfig(),
                 uuids: Callable[[], Sequence[str]] | None = None) -> None:
        """`uuids`: this process's GPU UUIDs by device index (default: asked of torch.cuda)."""
        super().__init__()
        self.config = config
        self._uuids_of = uuids or _visible_uuids
        self._uuids: tuple[str, ...] | None = None
        self._held: dict[bytes, tuple[float, list[torch.Tensor], torch.cuda.Event]] = {}

    @property
    def uuids(self) -> tuple[str, ...]:
        if self._uuids is None:
            self._uuids = tuple(self._uuids_of())
        return self._uuids

    async def send(self, request_id: str, header: bytes, tensors: Sequence[torch.Tensor],
                   *, timeout: float | None = None, stream: Any = None) -> CudaIpcHandle:
        """`stream`: the stream that wrote `tensors` (default: this thread's current stream on
        their device); the ready event is recorded on it, so the receiver waits for that work."""
        self._sweep()
        t0 = time.perf_counter()
        codec.check_parts(header, tensors)
        if not tensors or any(not t.is_cuda for t in tensors):
            raise ValueError("cuda_ipc sends CUDA tensors only (at least one)")
        device = tensors[0].device.index
        shared = [t.detach().contiguous() for t in tensors]
        event = record_ready(torch.cuda, stream if stream is not None else torch.cuda.current_stream(device))
        refs = tuple(_to_ref(t) for t in shared)
        ready = bytes(event.ipc_handle())
        self._held[ready] = (time.monotonic() + self.config.hold_s, shared, event)
        nbytes = sum(t.numel() * t.element_size() for t in shared)
        self._measured(nbytes, t0)
        return CudaIpcHandle(request_id, header, refs, ready, device, nbytes, self.uuids[device])

    async def recv(self, handle: Handle, *, timeout: float | None = None) -> tuple[bytes, list[torch.Tensor]]:
        self._expect(handle, CudaIpcHandle)
        t0 = time.perf_counter()
        out = await asyncio.to_thread(self._copy_in, handle)
        codec.check_parts(handle.header, out)
        self._measured(handle.nbytes, t0)
        return handle.header, out

    def _copy_in(self, h: CudaIpcHandle) -> list[torch.Tensor]:
        local = self._held.get(h.ready_event)
        src = h.device if local is not None else local_index(h.device_uuid, self.uuids)
        dst = torch.device("cuda", src if self.config.device is None else self.config.device)
        if local is not None:  # same process: CUDA cannot open its own IPC handles
            return [t.to(dst, copy=True) for t in local[1]]
        with torch.cuda.device(dst):
            stream = torch.cuda.current_stream(dst)
            torch.cuda.Event.from_ipc_handle(src, h.ready_event).wait(stream)
            mapped = [_from_ref(r, src) for r in h.tensors]
            out = [t.to(dst, copy=True) for t in mapped]
            stream.synchronize()  # copies done before the mapping (and producer's memory) goes
        del mapped
        return out

    def release(self, handle: Handle) -> None:
        if isinstance(handle, CudaIpcHandle):
            self._held.pop(handle.ready_event, None)

    async def close(self) -> None:
        self._held.clear()

    def _sweep(self) -> None:
        now = time.monotonic()
        for key, (expiry, _, _) in list(self._held.items()):
            if expiry <= now:
                del self._held[key]


def _visible_uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_index(uuid: str, uuids: Sequence[str]) -> int:
    """This process's device index of the GPU with `uuid` (its visible GPUs' UUIDs by index)."""
    if not uuid:
        raise InvalidRequest("the CUDA IPC handle names no GPU UUID; the sender must fill device_uuid")
    try:
        return list(uuids).index(uuid)
    except ValueError:
        raise Unavailable(f"GPU {uuid} of the CUDA IPC handle is not visible to this process (it sees "
                          f"{', '.join(uuids) or 'no GPU'}; check CUDA_VISIBLE_DEVICES)") from None


def record_ready(cuda: Any, stream: Any) -> Any:
    """An interprocess event recorded on `stream` (the one that wrote the KV). Run it with
    `stream`'s CUDA context current (a green stream: inside its backend's scope)."""
    event = cuda.Event(interprocess=True)
    event.record(stream)
    return event


def _to_ref(t: torch.Tensor) -> CudaTensorRef:
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_off,
     _grad, rc_handle, rc_offset, ev_handle, ev_sync) = args
    return CudaTensorRef(
        dtype=codec.dtype_name(dtype), shape=tuple(size), stride=tuple(stride), storage_offset=offset,
        device=int(device), storage_handle=bytes(handle or b""), storage_size_bytes=int(storage_size),
        storage_offset_bytes=int(storage_off), ref_counter_handle=bytes(rc_handle or b""),
        ref_counter_offset=int(rc_offset), event_handle=bytes(ev_handle or b""),
        event_sync_required=bool(ev_sync))


def _from_ref(r: CudaTensorRef, device: int) -> torch.Tensor:
    """Map the sender's allocation onto local device index `device` (not r.device, the sender's)."""
    if r.dtype not in codec.DTYPES:
        raise CodecError(f"unknown dtype {r.dtype!r} in a CUDA IPC handle")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(r.shape), r.stride, r.storage_offset, torch.storage.TypedStorage,
        codec.DTYPES[r.dtype], device, r.storage_handle or None, r.storage_size_bytes,
        r.storage_offset_bytes, False, r.ref_counter_handle, r.ref_counter_offset,
        r.event_handle or None, r.event_sync_required)
