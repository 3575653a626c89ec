"""The gated delta rule over a long prompt in chunks (plain torch, fp32), for prefill.

Token by token costs one small kernel sequence per token; in chunks of C tokens the
recurrence becomes a few matrix products per chunk (the WY form): within a chunk the
delta-rule updates are solved as one unit-lower-triangular system, and only the state passes
between chunks. Same maths as `delta_rule.gated_delta_rule`, different summation order, so
results agree to fp32 rounding, not bit for bit: prefill is shared by speculative and plain
decoding, so this does not affect their equality. Verify and decode keep the token-by-token
form, whose per-token results do not depend on the block length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 64


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes as `gated_delta_rule`: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H];
    state [B, H, Dk, Dv] fp32. Returns (outputs [B, T, H, Dv] fp32, final state)."""
    num_tokens = q.shape[1]
    padding = -num_tokens % chunk_tokens
    # Padded tokens have k = 0 and g = 0 (no decay): they leave the state unchanged.
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, padding)) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, 0, 0, padding)) for x in (g, beta))
    # → [B, H, N, C, ...]
    batch, heads = q.shape[0], q.shape[2]

    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        return x.reshape(batch, heads, -1, chunk_tokens, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    g_cum = g.cumsum(dim=-1)  # [B, H, N, C]
    # decay[i, j] = exp(g_cum_i - g_cum_j) for j <= i (the state decay from j to i)
    causal = torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # T = (I + strictly-lower(β_i k_i·k_j decay_ij))^-1: one unit-triangular solve, out of
    # place, so the same code also trains (autograd) the embedded model.
    strictly_lower = causal.tril(diagonal=-1)
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(chunk_tokens, device=q.device)
    solve = torch.linalg.solve_triangular(
        lower + eye, eye.expand_as(lower), upper=False, unitriangular=True
    )
    new_values = solve @ (v * beta.unsqueeze(-1))  # u before the state's contribution
    key_decayed = solve @ (k_beta * g_cum.exp().unsqueeze(-1))
    outputs = torch.empty_like(v)
    state = state.float().clone()
    for n in range(q.shape[2]):
        u = new_values[:, :, n] - key_decayed[:, :, n] @ state
        q_n, k_n, g_n = q[:, :, n], k[:, :, n], g_cum[:, :, n]
        intra = (q_n @ k_n.transpose(-1, -2)) * decay[:, :, n]
        outputs[:, :, n] = (q_n * g_n.exp().unsqueeze(-1)) @ state + intra @ u
        to_end = (g_n[..., -1:] - g_n).exp().unsqueeze(-1)
        state = state * g_n[..., -1].exp()[..., None, None] + (k_n * to_end).transpose(-1, -2) @ u
    outputs = outputs.reshape(batch, heads, -1, v.shape[-1])[:, :, :num_tokens]
    return outputs.transpose(1, 2), state
