"""What one forward pass of the target covers: which slots, from which positions, in which mode."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def ints_on_device(values, device: torch.device | str) -> torch.Tensor:
    """int64 `values` (a list, or nested lists of one length) as a tensor on `device`,
    without making the host wait: `torch.tensor(values, device=cuda)` blocks until the GPU has
    run everything queued, while a non-blocking copy of a host tensor returns once CUDA has
    staged the bytes, so the temporary may go at once."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


@dataclass(frozen=True)
class ForwardBatch:
    """B sequences (slots) each feeding `num_tokens` new tokens from its own start position.

    `is_verify` keeps the committed state untouched and records the block for a later
    commit; otherwise (prefill) every token is committed as it is computed.

    `slot_ids` / `start_ids` are the same slots and starts as device tensors. The GPU path
    reads only these, so a CUDA graph captured with one batch replays for any other whose
    tensors were copied into the same buffers (`on_device` builds them once per forward).
    `position_ids` are the tokens' positions computed from them once per forward
    (`with_positions`), for the layers that each need them.

    `valid_tokens` (prefill only) makes rows at and past it padding: a prefill CUDA graph
    runs one length for prompts up to it. Padding comes after every real token, so causal
    attention keeps the real rows as they were; the GDN layers give padding no decay and no
    update (decay and beta 0) and take their conv state from the last real tokens; keys
    written past the prompt lie beyond its length, masked until overwritten.
    """

    slots: tuple[int, ...]
    start_positions: tuple[int, ...]
    num_tokens: int
    is_verify: bool
    slot_ids: torch.Tensor | None = None  # int64 [B]
    start_ids: torch.Tensor | None = None  # int64 [B]
    position_ids: torch.Tensor | None = None  # int64 [B, T]
    valid_tokens: torch.Tensor | None = None  # int64 [B]: real rows; the rest are padding

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def on_device(self, device: torch.device | str) -> ForwardBatch:
        """This batch with its slots and starts also held as tensors on `device`."""
        ids = ints_on_device((self.slots, self.start_positions), device)
        return replace(self, slot_ids=ids[0], start_ids=ids[1])

    def slot_index(self, device: torch.device | str) -> torch.Tensor:
        if self.slot_ids is not None:
            return self.slot_ids
        return ints_on_device(self.slots, device)

    def start_index(self, device: torch.device | str) -> torch.Tensor:
        if self.start_ids is not None:
            return self.start_ids
        return ints_on_device(self.start_positions, device)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Absolute positions [B, T] of the new tokens."""
        if self.position_ids is not None:
            return self.position_ids
        starts = self.start_index(device).unsqueeze(1)
        return starts + torch.arange(self.num_tokens, device=starts.device)

    def with_positions(self, device: torch.device | str) -> ForwardBatch:
        """This batch with `positions` computed once (two launches on a GPU), for a forward
        whose attention layers each read them."""
        return replace(self, position_ids=self.positions(device))

    def real_rows(self, device: torch.device | str) -> torch.Tensor | None:
        """[B, T] bool, True at real rows; None where every row is real."""
        if self.valid_tokens is None:
            return None
        rows = torch.arange(self.num_tokens, device=device)
        return rows[None, :] < self.valid_tokens[:, None]
