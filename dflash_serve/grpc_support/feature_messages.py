"""Feature references between protobuf messages and the feature channel's dataclasses."""

from __future__ import annotations

from collections.abc import Iterable

from dflash_protos import features_pb2
from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_refs import InlineFeatures, SharedBufferInfo, SharedFeatures

TRANSPORTS = {
    "none": features_pb2.FEATURE_TRANSPORT_NONE,
    "inline": features_pb2.FEATURE_TRANSPORT_INLINE,
    "cuda_ipc": features_pb2.FEATURE_TRANSPORT_CUDA_IPC,
}
TRANSPORT_NAMES = {value: name for name, value in TRANSPORTS.items()}


def transport_name(value: int, default: str) -> str:
    """The transport's name; FEATURE_TRANSPORT_UNSPECIFIED (0) means `default`."""
    if value == features_pb2.FEATURE_TRANSPORT_UNSPECIFIED:
        return default
    if value not in TRANSPORT_NAMES:
        raise InvalidRequestError(f"feature_transport {value} is not one of {list(TRANSPORTS)}")
    return TRANSPORT_NAMES[value]


def feature_ref_message(features: InlineFeatures | SharedFeatures) -> features_pb2.FeatureRef:
    ref = features_pb2.FeatureRef(num_tokens=features.num_tokens, row_width=features.row_width)
    if isinstance(features, InlineFeatures):
        ref.inline.dtype = features.dtype
        ref.inline.num_chunks = len(features.chunks)
    else:
        ref.shared.buffer_id = features.buffer_id
        ref.shared.slot = features.slot
        ref.shared.start_position = features.start_position
    return ref


def chunk_messages(features: InlineFeatures | SharedFeatures) -> list[features_pb2.FeatureChunk]:
    if isinstance(features, SharedFeatures):
        return []
    return [features_pb2.FeatureChunk(index=i, data=c) for i, c in enumerate(features.chunks)]


def features_from_message(
    ref: features_pb2.FeatureRef, chunks: Iterable[features_pb2.FeatureChunk]
) -> InlineFeatures | SharedFeatures:
    """Rebuild the dataclass; chunks must arrive complete and in order."""
    kind = ref.WhichOneof("location")
    if kind == "shared":
        shared = ref.shared
        return SharedFeatures(
            shared.buffer_id, shared.slot, shared.start_position, ref.num_tokens, ref.row_width
        )
    if kind != "inline":
        raise InvalidRequestError("features: a FeatureRef needs an inline or shared location")
    data = []
    for expected_index, chunk in enumerate(chunks):
        if chunk.index != expected_index:
            raise InvalidRequestError(
                f"features: chunk {chunk.index} arrived where chunk {expected_index} was due"
            )
        data.append(chunk.data)
    return InlineFeatures(ref.num_tokens, ref.row_width, ref.inline.dtype, tuple(data))


def shared_buffer_message(info: SharedBufferInfo) -> features_pb2.SharedBuffer:
    return features_pb2.SharedBuffer(
        buffer_id=info.buffer_id, ipc_handle=info.ipc_handle, dtype=info.dtype, shape=info.shape
    )


def shared_buffer_from_message(message: features_pb2.SharedBuffer) -> SharedBufferInfo:
    return SharedBufferInfo(
        message.buffer_id, message.ipc_handle, message.dtype, tuple(message.shape)
    )
