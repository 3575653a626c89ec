"""The target's token choice: greedy, or seeded sampling keyed by (seed, absolute position).

Sampling uses the Gumbel-max trick with noise from an integer hash of (seed, position,
token id): the draw for a position depends on nothing else (not on the batch, the block or
the device), so speculative decoding reproduces target-only sampling exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_serve.speculative.types import SamplingParams

_MASK32 = 0xFFFFFFFF
# Multipliers below 2^31 keep every product of two 32-bit values inside int64.
_MIX_A = 0x7FEB352D
_MIX_B = 0x5BD1E995
_SEED_SALT = 0x2545F491
_POSITION_SALT = 0x3C6EF372


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit avalanche hash (xorshift-multiply), on int64 tensors holding 32-bit values or
    on Python ints (the same values: every product stays below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float64 [T, vocab]: a pure function of (seed, position, token id)."""
    device = positions.device
    seed_low, seed_high = seed & _MASK32, (seed >> 32) & _MASK32
    key = _mix32(_mix32(seed_low ^ _SEED_SALT) ^ seed_high)  # on the host: no device copy
    per_position = _mix32(key ^ ((positions.to(torch.int64) * _POSITION_SALT) & _MASK32))
    token_ids = torch.arange(vocab_size, device=device, dtype=torch.int64)
    bits = _mix32(_mix32(per_position.unsqueeze(-1) ^ token_ids) ^ per_position.unsqueeze(-1))
    return (bits.double() + 0.5) / 2.0**32


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled fp32 logits with tokens outside top-k / top-p set to -inf."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def choose_tokens(
    logits: torch.Tensor, positions: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """logits [T, vocab] predicting the tokens at absolute `positions` [T] → int64 [T]."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    scores = filter_logits(logits, params).double()
    gumbel = -torch.log(-torch.log(uniform_noise(params.seed, positions, logits.shape[-1])))
    return (scores + gumbel).argmax(dim=-1)


def choose_block_tokens(
    logits: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    params: Sequence[SamplingParams],
    first_rows: Sequence[int],
) -> list[list[int]]:
    """Tokens for a batch of blocks with one host sync for the greedy ones: row b of logits
    [B, T, vocab] has `lengths[b]` real rows predicting absolute positions starts[b] + 1 …;
    rows first_rows[b] .. lengths[b] − 1 are chosen (a prompt block needs only its last),
    each block by its own params. One argmax serves every greedy row; a sampled block runs
    `choose_tokens` on its chosen rows. A token depends only on its own logits and position,
    so this equals choosing each block alone."""
    chosen = logits.argmax(dim=-1)
    for b, p in enumerate(params):
        if not p.is_greedy:
            first, n = first_rows[b], lengths[b]
            positions = torch.arange(starts[b] + 1 + first, starts[b] + 1 + n, device=logits.device)
            chosen[b, first:n] = choose_tokens(logits[b, first:n], positions, p)
    on_host = chosen.tolist()
    return [row[first:n] for row, first, n in zip(on_host, first_rows, lengths, strict=True)]
