"""Where target features are, as plain data (no torch): what messages and clients carry.

The gateway passes these between the services without ever holding a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InlineFeatures:
    """Features as bytes: `num_tokens` rows of `row_width` elements of `dtype`."""

    num_tokens: int
    row_width: int
    dtype: str
    chunks: tuple[bytes, ...]


@dataclass(frozen=True)
class SharedFeatures:
    """Features in the target's exported CUDA buffer: rows start..start+n of a slot."""

    buffer_id: str
    slot: int
    start_position: int
    num_tokens: int
    row_width: int


@dataclass(frozen=True)
class SharedBufferInfo:
    """What a drafter needs to open the target's buffer in its own process."""

    buffer_id: str
    ipc_handle: bytes
    dtype: str
    shape: tuple[int, ...]
