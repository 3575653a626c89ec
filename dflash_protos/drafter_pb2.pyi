from dflash_protos import features_pb2 as _features_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_name", "target_model_name", "tap_layer_ids", "block_size", "max_drafts", "mask_token_id", "hidden_size", "device", "max_sessions", "max_context_tokens", "session_socket", "session_spin_us")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SESSION_SPIN_US_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    target_model_name: str
    tap_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    max_drafts: int
    mask_token_id: int
    hidden_size: int
    device: str
    max_sessions: int
    max_context_tokens: int
    session_socket: str
    session_spin_us: int
    def __init__(self, model_name: _Optional[str] = ..., target_model_name: _Optional[str] = ..., tap_layer_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., max_drafts: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., hidden_size: _Optional[int] = ..., device: _Optional[str] = ..., max_sessions: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., session_socket: _Optional[str] = ..., session_spin_us: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_active_sessions", "num_draft_batches", "num_draft_steps", "max_draft_batch_size", "draft_wait_us", "num_inline_draft_batches")
    NUM_ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    NUM_INLINE_DRAFT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    num_active_sessions: int
    num_draft_batches: int
    num_draft_steps: int
    max_draft_batch_size: int
    draft_wait_us: int
    num_inline_draft_batches: int
    def __init__(self, num_active_sessions: _Optional[int] = ..., num_draft_batches: _Optional[int] = ..., num_draft_steps: _Optional[int] = ..., max_draft_batch_size: _Optional[int] = ..., draft_wait_us: _Optional[int] = ..., num_inline_draft_batches: _Optional[int] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("feature_transport", "shared_buffer")
    FEATURE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHARED_BUFFER_FIELD_NUMBER: _ClassVar[int]
    feature_transport: _features_pb2.FeatureTransport
    shared_buffer: _features_pb2.SharedBuffer
    def __init__(self, feature_transport: _Optional[_Union[_features_pb2.FeatureTransport, str]] = ..., shared_buffer: _Optional[_Union[_features_pb2.SharedBuffer, _Mapping]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("features", "anchor_id", "num_drafts")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    features: _features_pb2.FeatureRef
    anchor_id: int
    num_drafts: int
    def __init__(self, features: _Optional[_Union[_features_pb2.FeatureRef, _Mapping]] = ..., anchor_id: _Optional[int] = ..., num_drafts: _Optional[int] = ...) -> None: ...

class RunSessionRequest(_message.Message):
    __slots__ = ("open", "draft", "feature_chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    draft: Draft
    feature_chunk: _features_pb2.FeatureChunk
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., feature_chunk: _Optional[_Union[_features_pb2.FeatureChunk, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class Drafted(_message.Message):
    __slots__ = ("draft_ids", "forward_ns", "batch_size")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_ns: int
    batch_size: int
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., forward_ns: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RunSessionResponse(_message.Message):
    __slots__ = ("opened", "drafted")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    drafted: Drafted
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., drafted: _Optional[_Union[Drafted, _Mapping]] = ...) -> None: ...
