from easerve.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaItem(_message.Message):
    __slots__ = ("info", "inputs", "content_hash")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TensorProto
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TensorProto, _Mapping]] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ItemMeta
    inputs: _containers.MessageMap[str, _common_pb2.TensorProto]
    content_hash: bytes
    def __init__(self, info: _Optional[_Union[_common_pb2.ItemMeta, _Mapping]] = ..., inputs: _Optional[_Mapping[str, _common_pb2.TensorProto]] = ..., content_hash: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("meta", "input_ids", "items", "sampling", "decode")
    META_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    sampling: _common_pb2.SamplingParams
    decode: _common_pb2.DecodeTarget
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., input_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.DecodeTarget, _Mapping]] = ...) -> None: ...

class HoldsRequest(_message.Message):
    __slots__ = ("content_hashes",)
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    content_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, content_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HoldsResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, held: _Optional[_Iterable[bool]] = ...) -> None: ...
