from easerve.wire.v1 import common_pb2 as _common_pb2
from easerve.wire.v1 import kv_pb2 as _kv_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("meta", "num_tokens", "max_new_tokens", "n")
    META_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    num_tokens: int
    max_new_tokens: int
    n: int
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., num_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("meta", "kv")
    META_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    kv: _kv_pb2.KVTransfer
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., kv: _Optional[_Union[_kv_pb2.KVTransfer, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("kv_transfer_ms",)
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    kv_transfer_ms: float
    def __init__(self, kv_transfer_ms: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running", "waiting", "max_waiting", "kv_free_tokens", "kv_total_tokens", "kv_free_bytes", "reserved")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    max_waiting: int
    kv_free_tokens: int
    kv_total_tokens: int
    kv_free_bytes: int
    reserved: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_waiting: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., kv_total_tokens: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., reserved: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
