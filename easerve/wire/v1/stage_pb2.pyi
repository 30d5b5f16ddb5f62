from easerve.wire.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("stage", "inflight", "max_inflight", "queued", "node", "kv_free_tokens", "kv_total_tokens", "busy_s", "recent_batch_s", "recent_batch_size", "overdue")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    RECENT_BATCH_S_FIELD_NUMBER: _ClassVar[int]
    RECENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OVERDUE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    inflight: int
    max_inflight: int
    queued: int
    node: _common_pb2.NodeIdentity
    kv_free_tokens: int
    kv_total_tokens: int
    busy_s: float
    recent_batch_s: float
    recent_batch_size: float
    overdue: int
    def __init__(self, stage: _Optional[str] = ..., inflight: _Optional[int] = ..., max_inflight: _Optional[int] = ..., queued: _Optional[int] = ..., node: _Optional[_Union[_common_pb2.NodeIdentity, _Mapping]] = ..., kv_free_tokens: _Optional[int] = ..., kv_total_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., recent_batch_s: _Optional[float] = ..., recent_batch_size: _Optional[float] = ..., overdue: _Optional[int] = ...) -> None: ...

class ShmProbeRequest(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ShmProbeResponse(_message.Message):
    __slots__ = ("readable",)
    READABLE_FIELD_NUMBER: _ClassVar[int]
    readable: bool
    def __init__(self, readable: _Optional[bool] = ...) -> None: ...
