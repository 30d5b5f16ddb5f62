from easerve.wire.v1 import common_pb2 as _common_pb2
from easerve.wire.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Embeddings(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorProto]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_common_pb2.TensorProto, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("meta", "input_ids", "items", "embeddings", "sampling", "decode", "embeddings_transfer")
    META_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.ItemMeta]
    embeddings: Embeddings
    sampling: _common_pb2.SamplingParams
    decode: _common_pb2.DecodeTarget
    embeddings_transfer: _kv_pb2.KVTransfer
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., input_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[_common_pb2.ItemMeta, _Mapping]]] = ..., embeddings: _Optional[_Union[Embeddings, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.DecodeTarget, _Mapping]] = ..., embeddings_transfer: _Optional[_Union[_kv_pb2.KVTransfer, _Mapping]] = ...) -> None: ...
