"""Per-slot keys/values of the drafter's context: the committed tokens' target features.

Positions 0 .. length − 1 of a slot hold its committed context; nothing else is ever read as
context. A draft writes its own block's keys/values as scratch at positions length .. length
+ T − 1, where its attention reads them (the GPU kernel by position, the plain path as one
view with the context) and the next `add_context` overwrites them. The room for one block
past `max_len` lets that scratch write stay in bounds for any committed length.
"""

from __future__ import annotations

import torch

from drafter_service.model.config import DFlashConfig


class DrafterContextCache:
    """keys/values [layers, slots, max_len + block_size, kv_heads, head_dim] and a committed
    length per slot (at most `max_len`)."""

    def __init__(
        self,
        config: DFlashConfig,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (
            config.num_hidden_layers,
            max_slots,
            max_len + config.block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_len = max_len
        self.lengths = [0] * max_slots
