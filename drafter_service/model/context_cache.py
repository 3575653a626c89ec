"""Per-slot keys/values of the drafter's context: the committed tokens' target features.

It only grows with committed tokens; a draft's own block keys/values are never stored.
"""

from __future__ import annotations

import torch

from drafter_service.model.config import DFlashConfig


class DrafterContextCache:
    """keys/values [layers, slots, max_len, kv_heads, head_dim] and a length per slot."""

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
            max_len,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_len = max_len
        self.lengths = [0] * max_slots
