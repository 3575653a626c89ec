"""The DFlash training step: many random anchor blocks per sequence in one forward.

Recipe (DFlash / SpecForge): pick random anchors in each target-generated sequence; block =
[token at anchor, MASK × (block−1)] at the anchor's absolute positions; the block sees the
target features of every token before its anchor and (per layer rule) its own block, never
another block; slot k is labelled with the token at anchor + k (same position, no shift),
cross-entropy weighted by exp(−(k−1)/γ). This is the serving drafter's forward
(`DFlashDrafter.draft_logits`) with all blocks of a batch packed together; a test checks the
two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.layers.attention import attend_masked
from drafter_service.model.dflash import DFlashDrafter

LOSS_DECAY_GAMMA = 7.0


def sample_anchors(
    first_ids: torch.Tensor, lengths: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, A] anchors uniform in [first, length − 2] per sequence (at least one label each)."""
    span = (lengths - 1 - first_ids).clamp(min=1)
    draws = torch.rand(len(lengths), num_anchors, generator=generator)
    return first_ids.unsqueeze(1) + (draws * span.unsqueeze(1)).long()


def block_logits(
    drafter: DFlashDrafter, taps: torch.Tensor, token_ids: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """taps [B, T, F] of the target, token_ids [B, T], anchors [B, A] →
    fp32 logits [B, A, block−1, vocab] for block slots 1..block−1."""
    config = drafter.config
    num_seqs, num_tokens = token_ids.shape
    num_anchors, block = anchors.shape[1], config.block_size
    device = token_ids.device
    context = drafter.hidden_norm(drafter.fc(taps.to(drafter.fc.weight.dtype)))
    context_pos = torch.arange(num_tokens, device=device).expand(num_seqs, num_tokens)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(block, device=device)).flatten(1)
    block_ids = torch.full((num_seqs, num_anchors, block), config.mask_token_id, device=device)
    block_ids[..., 0] = token_ids.gather(1, anchors)
    h = nn.functional.embedding(block_ids.flatten(1), drafter.embed_weight)
    h = h * config.input_embedding_scale
    context_cos_sin = drafter.rotary.cos_sin(context_pos)
    block_cos_sin = drafter.rotary.cos_sin(block_pos)
    owner = torch.arange(num_anchors, device=device).repeat_interleave(block)
    sees_context = context_pos.unsqueeze(1) < anchors.repeat_interleave(block, 1).unsqueeze(2)
    sees_block = (owner.unsqueeze(1) == owner.unsqueeze(0)).expand(num_seqs, -1, -1)
    allowed = torch.cat((sees_context, sees_block), dim=2)  # [B, A·block, T + A·block]
    key_pos = torch.cat((context_pos, block_pos), dim=1)
    for layer_id, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        visible = allowed & drafter.visible_by_position(
            layer_id, block_pos.unsqueeze(2), key_pos.unsqueeze(1)
        )
        x = layer.input_layernorm(h)
        context_keys, context_values = attn.keys_values(context, context_cos_sin)
        block_keys, block_values = attn.keys_values(x, block_cos_sin)
        out = attend_masked(
            attn.queries(x, block_cos_sin),
            torch.cat((context_keys, block_keys), dim=1),
            torch.cat((context_values, block_values), dim=1),
            visible,
            attn.head_dim**-0.5,
        )
        h = h + attn.o_proj(out.flatten(2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = h.reshape(num_seqs, num_anchors, block, -1)[:, :, 1:]
    return drafter.head_logits(h)


def block_loss(
    logits: torch.Tensor, token_ids: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decay-weighted cross-entropy, per-slot accuracy of the accepted prefix [block−1]).

    The second value estimates acceptance: slot k counts only when slots 1..k are all right.
    """
    num_slots = logits.shape[2]
    offsets = torch.arange(1, num_slots + 1, device=token_ids.device)
    label_pos = anchors.unsqueeze(-1) + offsets  # [B, A, K]
    is_valid = label_pos < lengths.view(-1, 1, 1)
    flat_pos = label_pos.clamp(max=token_ids.shape[1] - 1).flatten(1)
    labels = token_ids.gather(1, flat_pos).view_as(label_pos)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    weights = torch.exp(-(offsets - 1) / LOSS_DECAY_GAMMA) * is_valid
    loss = (ce.view_as(weights) * weights).sum() / weights.sum()
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & is_valid
        prefix = correct.long().cumprod(-1).float()
        full_blocks = is_valid.all(-1)  # judge the prefix only where all slots have labels
        accuracy = prefix[full_blocks].mean(0) if full_blocks.any() else prefix.new_zeros(0)
    return loss, accuracy
