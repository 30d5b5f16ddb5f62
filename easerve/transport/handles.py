"""Typed transfer handles, one per backend, and their easerve.v1.KVTransfer form.

A handle says where a codec payload (parts header + tensors) is and how to fetch it;
it is small and crosses processes inside DecodeRequest / PrefillRequest.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Union

from easerve.wire.v1 import kv_pb2


@dataclass(frozen=True)
class InlineHandle:
    request_id: str
    data: bytes  # the whole codec frame

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class ShmHandle:
    request_id: str
    name: str  # POSIX shm name without the leading "/"
    offset: int
    size: int
    slab: bool = False  # a region of the sender's slab (else a one-off segment)
    generation: int = 0

    @property
    def nbytes(self) -> int:
        return self.size


@dataclass(frozen=True)
class GrpcHandle:
    request_id: str
    endpoint: str  # receiver's KVStream address
    key: str
    nbytes: int


@dataclass(frozen=True)
class CudaTensorRef:
    """The fields of torch.multiprocessing.reductions.reduce_tensor for a CUDA tensor."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class CudaIpcHandle:
    request_id: str
    header: bytes
    tensors: tuple[CudaTensorRef, ...]
    ready_event: bytes
    device: int
    nbytes: int
    device_uuid: str = ""  # the GPU's UUID; the receiver maps it to its own device index


@dataclass(frozen=True)
class NcclHandle:
    request_id: str
    src_rank: int
    dst_rank: int
    tag: int
    nbytes: int


Handle = Union[InlineHandle, ShmHandle, GrpcHandle, CudaIpcHandle, NcclHandle]


def handle_to_proto(h: Handle) -> kv_pb2.KVTransfer:
    msg = kv_pb2.KVTransfer(request_id=h.request_id, nbytes=h.nbytes)
    if isinstance(h, InlineHandle):
        msg.inline = h.data
    elif isinstance(h, ShmHandle):
        msg.shm.CopyFrom(kv_pb2.ShmSegment(name=h.name, offset=h.offset, size=h.size,
                                           slab=h.slab, generation=h.generation))
    elif isinstance(h, GrpcHandle):
        msg.grpc.CopyFrom(kv_pb2.GrpcStream(endpoint=h.endpoint, key=h.key))
    elif isinstance(h, NcclHandle):
        msg.nccl.CopyFrom(kv_pb2.NcclPeer(src_rank=h.src_rank, dst_rank=h.dst_rank, tag=h.tag))
    elif isinstance(h, CudaIpcHandle):
        msg.cuda_ipc.CopyFrom(kv_pb2.CudaIpc(
            header=h.header, ready_event=h.ready_event, device=h.device, device_uuid=h.device_uuid,
            tensors=[kv_pb2.CudaIpcTensor(**{f.name: getattr(r, f.name) for f in fields(r)})
                     for r in h.tensors]))
    else:
        raise TypeError(f"not a transfer handle: {type(h).__name__}")
    return msg


def handle_from_proto(msg: kv_pb2.KVTransfer) -> Handle:
    """KVTransfer -> typed handle; ValueError when no location is set."""
    which = msg.WhichOneof("location")
    rid = msg.request_id
    if which == "inline":
        return InlineHandle(rid, bytes(msg.inline))
    if which == "shm":
        s = msg.shm
        return ShmHandle(rid, s.name, s.offset, s.size, s.slab, s.generation)
    if which == "grpc":
        return GrpcHandle(rid, msg.grpc.endpoint, msg.grpc.key, msg.nbytes)
    if which == "nccl":
        return NcclHandle(rid, msg.nccl.src_rank, msg.nccl.dst_rank, msg.nccl.tag, msg.nbytes)
    if which == "cuda_ipc":
        c = msg.cuda_ipc
        refs = tuple(CudaTensorRef(
            t.dtype, tuple(t.shape), tuple(t.stride), t.storage_offset, t.device, t.storage_handle,
            t.storage_size_bytes, t.storage_offset_bytes, t.ref_counter_handle, t.ref_counter_offset,
            t.event_handle, t.event_sync_required) for t in c.tensors)
        return CudaIpcHandle(rid, c.header, refs, c.ready_event, c.device, msg.nbytes, c.device_uuid)
    raise ValueError(f"KVTransfer for request {rid!r} has no location set")
