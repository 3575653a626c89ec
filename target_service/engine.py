"""The target engine: sequence slots and the three operations the service exposes.

- `prefill(slot, prompt_ids)`: commit a prompt; return the last position's logits and the
  tapped hidden states of every prompt token (chunked, so long prompts never need
  prompt-length × vocab logits).
- `verify(slots, block_ids)`: run 1..16 tokens per sequence without committing; return the
  logits and taps at every block position.
- `commit(slot, n)`: keep the first n tokens of the last verified block, roll back the rest.
Plain decoding is `verify` of one token followed by `commit(slot, 1)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_serve.errors import CapacityError, InvalidRequestError
from target_service.model.commit import commit_block
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import StateShape, TargetState

DEFAULT_PREFILL_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class PrefillResult:
    last_logits: torch.Tensor  # [vocab] fp32, predicts the token after the prompt
    taps: torch.Tensor | None  # [prompt_len, num_taps * hidden], or None without tap layers


@dataclass(frozen=True)
class VerifyResult:
    logits: torch.Tensor  # [B, T, vocab] fp32; row t predicts the token after block token t
    taps: torch.Tensor | None  # [B, T, num_taps * hidden]


class TargetEngine:
    """Owns the model and its preallocated state; callers address sequences by slot."""

    def __init__(
        self,
        model: Qwen35TextModel,
        shape: StateShape,
        tap_layer_ids: tuple[int, ...] = (),
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> None:
        config = model.config
        bad = [i for i in tap_layer_ids if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise InvalidRequestError(
                f"tap_layer_ids {bad} out of range: the target has "
                f"{config.num_hidden_layers} layers (ids 0..{config.num_hidden_layers - 1})"
            )
        self.model = model
        self.config = config
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.state = TargetState(config, shape, self.dtype, self.device)
        self._free_slots = list(range(shape.max_slots - 1, -1, -1))

    @property
    def num_active(self) -> int:
        return self.state.shape.max_slots - len(self._free_slots)

    def open_sequence(self) -> int:
        """Reserve a slot with empty state; CapacityError when all are in use."""
        if not self._free_slots:
            raise CapacityError(f"all {self.state.shape.max_slots} sequence slots are in use")
        slot = self._free_slots.pop()
        self.state.reset_slot(slot)
        return slot

    def close_sequence(self, slot: int) -> None:
        self._check_slot(slot)
        self._free_slots.append(slot)

    def length(self, slot: int) -> int:
        """Committed tokens of the sequence."""
        return self.state.lengths[slot]

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int]) -> PrefillResult:
        self._check_slot(slot)
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids is empty; a prompt needs at least one token")
        self._check_ids(prompt_ids, "prompt_ids")
        self._check_room(slot, len(prompt_ids))
        taps = []
        hidden = None
        for start in range(0, len(prompt_ids), self.prefill_chunk_tokens):
            chunk = prompt_ids[start : start + self.prefill_chunk_tokens]
            batch = ForwardBatch((slot,), (self.state.lengths[slot],), len(chunk), is_verify=False)
            ids = torch.tensor([chunk], device=self.device)
            hidden, tapped = self.model(ids, batch, self.state, self.tap_layer_ids)
            self.state.lengths[slot] += len(chunk)
            if tapped is not None:
                taps.append(tapped[0])
        last_logits = self.model.logits(hidden[0, -1])
        return PrefillResult(last_logits, torch.cat(taps) if taps else None)

    @torch.inference_mode()
    def verify(self, slots: list[int], block_ids: list[list[int]]) -> VerifyResult:
        """Run one block per sequence (all blocks the same length) without committing."""
        if len(slots) != len(block_ids) or not slots:
            raise InvalidRequestError(
                f"verify needs one block per slot; got {len(slots)} slots, {len(block_ids)} blocks"
            )
        if len(set(slots)) != len(slots):
            raise InvalidRequestError(f"verify got a slot twice: {slots}")
        num_tokens = len(block_ids[0])
        limit = self.state.shape.max_block_tokens
        for slot, block in zip(slots, block_ids, strict=True):
            self._check_slot(slot)
            if len(block) != num_tokens or not 1 <= num_tokens <= limit:
                raise InvalidRequestError(
                    f"block lengths must be equal and in 1..{limit}; got "
                    f"{[len(b) for b in block_ids]}"
                )
            self._check_ids(block, "block_ids")
            self._check_room(slot, num_tokens)
        starts = tuple(self.state.lengths[s] for s in slots)
        batch = ForwardBatch(tuple(slots), starts, num_tokens, is_verify=True)
        ids = torch.tensor(block_ids, device=self.device)
        hidden, taps = self.model(ids, batch, self.state, self.tap_layer_ids)
        for slot in slots:
            self.state.block_sizes[slot] = num_tokens
        return VerifyResult(self.model.logits(hidden), taps)

    @torch.inference_mode()
    def commit(self, slot: int, num_kept: int) -> None:
        """Keep the first `num_kept` tokens of the slot's last verified block."""
        self._check_slot(slot)
        block_size = self.state.block_sizes[slot]
        if block_size == 0:
            raise InvalidRequestError(f"slot {slot}: commit without a verified block")
        if not 1 <= num_kept <= block_size:
            raise InvalidRequestError(
                f"slot {slot}: num_kept must be in 1..{block_size}, got {num_kept}"
            )
        commit_block(self.state, slot, num_kept)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.state.shape.max_slots or slot in self._free_slots:
            raise InvalidRequestError(f"slot {slot} is not an open sequence")

    def _check_ids(self, ids: list[int], what: str) -> None:
        vocab = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(
                f"{what}: token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}"
            )

    def _check_room(self, slot: int, num_new: int) -> None:
        max_len = self.state.shape.max_len
        if self.state.lengths[slot] + num_new > max_len:
            raise InvalidRequestError(
                f"slot {slot}: {self.state.lengths[slot]} committed + {num_new} new tokens "
                f"exceed max_len {max_len}"
            )
