"""Facts each service reports about itself (GetInfo), as plain data shared by the service
that fills them and the clients that read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetInfo:
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_tokens: int
    tap_layer_ids: tuple[int, ...]
    max_block_tokens: int
    hidden_size: int
    device: str
    max_sessions: int


@dataclass(frozen=True)
class DrafterInfo:
    model_name: str
    target_model_name: str
    tap_layer_ids: tuple[int, ...]
    block_size: int
    max_drafts: int
    mask_token_id: int
    hidden_size: int
    device: str
    max_sessions: int
    max_context_tokens: int
