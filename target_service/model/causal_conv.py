"""Depthwise causal conv1d over new tokens, continuing from a conv state.

The conv state of a sequence is its last `kernel − 1` pre-conv inputs. The result for each
token is a fixed-order sum of `kernel` products, so it does not depend on how many tokens
are convolved together.
"""

from __future__ import annotations

import torch


def causal_conv_with_state(
    inputs: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs [B, T, C] (pre-conv), conv_state [B, C, k−1], weight [C, k].

    Returns (outputs [B, T, C] before activation, new conv state [B, C, k−1]).
    """
    kernel = weight.shape[1]
    window = torch.cat((conv_state.transpose(1, 2).to(inputs.dtype), inputs), dim=1)
    num_tokens = inputs.shape[1]
    out = window[:, 0:num_tokens] * weight[:, 0]
    for j in range(1, kernel):
        out = out + window[:, j : j + num_tokens] * weight[:, j]
    new_state = window[:, num_tokens:].transpose(1, 2)
    return out, new_state


def conv_state_after(
    conv_state: torch.Tensor, inputs: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Conv state [..., C, k−1] after the first `num_tokens` of inputs [..., T, C] were committed.

    Leading dims (layers) are carried along; the result is a copy of stored values, no maths.
    """
    history = conv_state.shape[-1]
    newest = inputs[..., max(0, num_tokens - history) : num_tokens, :]  # all that can stay
    window = torch.cat((conv_state.transpose(-1, -2).to(inputs.dtype), newest), dim=-2)
    return window[..., window.shape[-2] - history :, :].transpose(-1, -2)


def conv_states_after(
    conv_state: torch.Tensor, inputs: torch.Tensor, num_tokens: torch.Tensor
) -> torch.Tensor:
    """`conv_state_after` for a batch: conv states [..., B, C, k−1] after the first
    `num_tokens[b]` of inputs [..., B, T, C], num_tokens int64 [B] on the inputs' device.

    Row b's new history is rows num_tokens[b] .. num_tokens[b] + k − 2 of
    [old history ; inputs], gathered: copies of stored values, no maths.
    """
    history = conv_state.shape[-1]
    window = torch.cat((conv_state.transpose(-1, -2).to(inputs.dtype), inputs), dim=-2)
    rows = num_tokens[:, None] + torch.arange(history, device=inputs.device)  # [B, k−1]
    index = rows[:, :, None].expand(*window.shape[:-2], history, window.shape[-1])
    return window.gather(-2, index).transpose(-1, -2)
