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
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "max_context_tokens", "tap_layer_ids", "max_block_tokens", "hidden_size", "device", "max_sessions", "session_socket", "session_spin_us")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SESSION_SPIN_US_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_tokens: int
    tap_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_block_tokens: int
    hidden_size: int
    device: str
    max_sessions: int
    session_socket: str
    session_spin_us: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_tokens: _Optional[int] = ..., tap_layer_ids: _Optional[_Iterable[int]] = ..., max_block_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., device: _Optional[str] = ..., max_sessions: _Optional[int] = ..., session_socket: _Optional[str] = ..., session_spin_us: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_active_sessions", "num_verify_batches", "num_verify_steps", "max_verify_batch_size", "verify_wait_us", "num_inline_verify_batches")
    NUM_ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_VERIFY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    NUM_INLINE_VERIFY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    num_active_sessions: int
    num_verify_batches: int
    num_verify_steps: int
    max_verify_batch_size: int
    verify_wait_us: int
    num_inline_verify_batches: int
    def __init__(self, num_active_sessions: _Optional[int] = ..., num_verify_batches: _Optional[int] = ..., num_verify_steps: _Optional[int] = ..., max_verify_batch_size: _Optional[int] = ..., verify_wait_us: _Optional[int] = ..., num_inline_verify_batches: _Optional[int] = ...) -> None: ...

class GetFeatureBufferRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFeatureBufferResponse(_message.Message):
    __slots__ = ("buffer",)
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    buffer: _features_pb2.SharedBuffer
    def __init__(self, buffer: _Optional[_Union[_features_pb2.SharedBuffer, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("sampling", "feature_transport")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    sampling: SamplingParams
    feature_transport: _features_pb2.FeatureTransport
    def __init__(self, sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., feature_transport: _Optional[_Union[_features_pb2.FeatureTransport, str]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("prompt_ids",)
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RunSessionRequest(_message.Message):
    __slots__ = ("open", "prefill", "verify")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    prefill: Prefill
    verify: Verify
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("token_ids", "num_accepted", "features", "forward_ns", "batch_size")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    features: _features_pb2.FeatureRef
    forward_ns: int
    batch_size: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., features: _Optional[_Union[_features_pb2.FeatureRef, _Mapping]] = ..., forward_ns: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RunSessionResponse(_message.Message):
    __slots__ = ("opened", "step", "feature_chunk")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    step: StepResult
    feature_chunk: _features_pb2.FeatureChunk
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ..., feature_chunk: _Optional[_Union[_features_pb2.FeatureChunk, _Mapping]] = ...) -> None: ...
