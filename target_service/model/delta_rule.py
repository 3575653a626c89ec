"""The gated delta rule recurrence (plain torch, fp32), token by token.

Per token and value head: S ← exp(g)·S;  u = β·(v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq.
Processing tokens one at a time in a fixed order makes the state after n tokens identical
whether those tokens came alone or as the prefix of a longer block, which is what lets a
partly rejected block be undone by replaying only the accepted tokens.
"""

from __future__ import annotations

import torch

L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(Σx² + eps) over the last dim, in fp32 (as fla and transformers do)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D]: each q/k head serves Hv/Hk consecutive value heads."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hv, Dk] (normalised, q scaled); v [B, T, Hv, Dv]; g, beta [B, T, Hv];
    state [B, Hv, Dk, Dv] fp32. Returns (outputs [B, T, Hv, Dv] fp32, final state)."""
    outputs = []
    for t in range(q.shape[1]):
        state = advance_state(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        outputs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outputs, dim=1), state


def advance_state(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token: state [B, Hv, Dk, Dv]; k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - remembered) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def replay_state(
    state: torch.Tensor,
    raw_keys: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """State after feeding the given tokens to state [Hv, Dk, Dv]; no outputs.

    raw_keys [T, Hk, Dk] are the keys before l2 normalisation, as the block recorded them;
    they are normalised exactly as the forward normalised them. v [T, Hv, Dv], g, beta [T, Hv].
    """
    k = expand_key_heads(l2_normalize(raw_keys), state.shape[0])
    state = state.unsqueeze(0)
    for t in range(k.shape[0]):
        state = advance_state(state, k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1])
    return state.squeeze(0)
