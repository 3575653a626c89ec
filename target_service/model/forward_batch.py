"""What one forward pass of the target covers: which slots, from which positions, in which mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """B sequences (slots) each feeding `num_tokens` new tokens from its own start position.

    `is_verify` keeps the committed state untouched and records the block for a later
    commit; otherwise (prefill) every token is committed as it is computed.
    """

    slots: tuple[int, ...]
    start_positions: tuple[int, ...]
    num_tokens: int
    is_verify: bool

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Absolute positions [B, T] of the new tokens."""
        starts = torch.tensor(self.start_positions, device=device).unsqueeze(1)
        return starts + torch.arange(self.num_tokens, device=device)

    def slot_index(self, device: torch.device | str) -> torch.Tensor:
        return torch.tensor(self.slots, device=device)
