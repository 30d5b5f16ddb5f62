from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmSegment(_message.Message):
    __slots__ = ("name", "offset", "size", "slab", "generation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    size: int
    slab: bool
    generation: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., slab: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("dtype", "shape", "stride", "storage_offset", "device", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., device: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("header", "tensors", "ready_event", "device", "device_uuid")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[CudaIpcTensor]
    ready_event: bytes
    device: int
    device_uuid: str
    def __init__(self, header: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[CudaIpcTensor, _Mapping]]] = ..., ready_event: _Optional[bytes] = ..., device: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class NcclPeer(_message.Message):
    __slots__ = ("src_rank", "dst_rank", "tag")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    dst_rank: int
    tag: int
    def __init__(self, src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., tag: _Optional[int] = ...) -> None: ...

class GrpcStream(_message.Message):
    __slots__ = ("endpoint", "key")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    key: str
    def __init__(self, endpoint: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("request_id", "nbytes", "inline", "shm", "cuda_ipc", "nccl", "grpc")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    nbytes: int
    inline: bytes
    shm: ShmSegment
    cuda_ipc: CudaIpc
    nccl: NcclPeer
    grpc: GrpcStream
    def __init__(self, request_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., inline: _Optional[bytes] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpc, _Mapping]] = ..., nccl: _Optional[_Union[NcclPeer, _Mapping]] = ..., grpc: _Optional[_Union[GrpcStream, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("key", "total_bytes", "deadline_ms", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_bytes: int
    deadline_ms: int
    data: bytes
    def __init__(self, key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVPushAck(_message.Message):
    __slots__ = ("key", "received_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    received_bytes: int
    def __init__(self, key: _Optional[str] = ..., received_bytes: _Optional[int] = ...) -> None: ...
