"""Moving target features (tapped hidden states of committed tokens) to the drafter.

Two transports, one contract (the drafter receives exactly the target's rows):
- inline: row-major bytes cut into chunks of at most `CHUNK_BYTES`, so even the 335 MB of
  an 8192-token prompt never travels as one message;
- shared CUDA buffer: on one GPU the target writes features into a buffer indexed by
  [slot, absolute position] that it exports once through CUDA IPC; a step only carries
  (slot, start position, number of tokens).
"""

from __future__ import annotations

import pickle
import uuid

import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_refs import InlineFeatures, SharedBufferInfo

CHUNK_BYTES = 2 * 1024 * 1024
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_inline(features: torch.Tensor) -> InlineFeatures:
    """A [n, width] tensor as chunked bytes (copied to the host)."""
    rows = features.detach().contiguous().cpu()
    raw = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
    chunks = tuple(raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES))
    return InlineFeatures(rows.shape[0], rows.shape[1], dtype_name(rows.dtype), chunks)


def decode_inline(features: InlineFeatures, device: torch.device | str) -> torch.Tensor:
    """Rebuild the [n, width] tensor; a byte count that does not fit raises."""
    if features.dtype not in DTYPES:
        raise InvalidRequestError(f"feature dtype {features.dtype!r} is not one of {list(DTYPES)}")
    dtype = DTYPES[features.dtype]
    raw = b"".join(features.chunks)
    expected = features.num_tokens * features.row_width * torch.empty(0, dtype=dtype).itemsize
    if len(raw) != expected:
        raise InvalidRequestError(
            f"inline features: {len(raw)} bytes received, {features.num_tokens} rows × "
            f"{features.row_width} {features.dtype} need {expected}"
        )
    if not raw:
        return torch.empty(features.num_tokens, features.row_width, dtype=dtype, device=device)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    return flat.reshape(features.num_tokens, features.row_width).to(device)


class SharedFeatureBuffer:
    """The target's CUDA buffer [slots, max_positions, row_width], exported through CUDA IPC."""

    def __init__(self, max_slots, max_positions, row_width, dtype, device) -> None:
        self.tensor = torch.zeros(max_slots, max_positions, row_width, dtype=dtype, device=device)
        self.buffer_id = uuid.uuid4().hex

    def export(self) -> SharedBufferInfo:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        return SharedBufferInfo(
            self.buffer_id,
            pickle.dumps(args),
            dtype_name(self.tensor.dtype),
            tuple(self.tensor.shape),
        )

    def write(self, slot: int, start: int, rows: torch.Tensor) -> None:
        self.tensor[slot, start : start + rows.shape[0]] = rows


def open_shared_buffer(info: SharedBufferInfo) -> torch.Tensor:
    """Map the target's buffer into this process (same GPU, shared IPC namespace)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # The handle comes from our own target over a local channel; it is trusted like the
    # checkpoint the target loaded.
    return rebuild_cuda_tensor(*pickle.loads(info.ipc_handle))
