from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_TRANSPORT_UNSPECIFIED: _ClassVar[FeatureTransport]
    FEATURE_TRANSPORT_NONE: _ClassVar[FeatureTransport]
    FEATURE_TRANSPORT_INLINE: _ClassVar[FeatureTransport]
    FEATURE_TRANSPORT_CUDA_IPC: _ClassVar[FeatureTransport]
FEATURE_TRANSPORT_UNSPECIFIED: FeatureTransport
FEATURE_TRANSPORT_NONE: FeatureTransport
FEATURE_TRANSPORT_INLINE: FeatureTransport
FEATURE_TRANSPORT_CUDA_IPC: FeatureTransport

class FeatureRef(_message.Message):
    __slots__ = ("num_tokens", "row_width", "inline", "shared")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    row_width: int
    inline: InlineFeatures
    shared: SharedFeatures
    def __init__(self, num_tokens: _Optional[int] = ..., row_width: _Optional[int] = ..., inline: _Optional[_Union[InlineFeatures, _Mapping]] = ..., shared: _Optional[_Union[SharedFeatures, _Mapping]] = ...) -> None: ...

class InlineFeatures(_message.Message):
    __slots__ = ("dtype", "num_chunks")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_chunks: int
    def __init__(self, dtype: _Optional[str] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class SharedFeatures(_message.Message):
    __slots__ = ("buffer_id", "slot", "start_position")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    slot: int
    start_position: int
    def __init__(self, buffer_id: _Optional[str] = ..., slot: _Optional[int] = ..., start_position: _Optional[int] = ...) -> None: ...

class FeatureChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SharedBuffer(_message.Message):
    __slots__ = ("buffer_id", "ipc_handle", "dtype", "shape")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    ipc_handle: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, buffer_id: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...
