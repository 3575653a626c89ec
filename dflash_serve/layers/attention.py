"""Scaled dot-product attention over cached keys, with grouped query heads.

Two paths share one contract (softmax(q·kᵀ·scale)·v per query over the keys it may see):
- `attend_each_query` computes every query over exactly its own visible key range, so a
  token's result is identical whether it arrives alone or in a 16-token block (the property
  lossless speculative decoding needs on the verify/decode path);
- `attend_masked` computes many queries at once with a boolean mask (drafting),
  `attend_all` the case where every key is visible (a non-causal draft block), and
  `attend_causal` the causal case of a prompt chunk without a mask (prefill), where only
  closeness, not bit-equality with another shape, matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# A prompt's first chunk (as many queries as keys) goes through SDPA's dispatcher as plain
# causal attention, which on an H200 picked cuDNN's kernel: it builds (and caches) a plan for
# each new pair of lengths, and prompt lengths vary. Flash is asked for instead.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., H, D] -> [..., Hkv, H/Hkv, D]: query heads h*G..h*G+G-1 share kv head h."""
    *lead, num_heads, dim = q.shape
    return q.reshape(*lead, num_kv_heads, num_heads // num_kv_heads, dim)


def attend_each_query(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_ranges: list[tuple[int, int]],
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; keys/values [L, Hkv, D]; query t sees keys[lo:hi] for (lo, hi) = key_ranges[t].

    Returns [T, H, D] in q's dtype; softmax in fp32.
    """
    num_kv_heads = keys.shape[1]
    outputs = []
    for t, (lo, hi) in enumerate(key_ranges):
        q_t = _grouped(q[t], num_kv_heads).float()  # [Hkv, G, D]
        k_t = keys[lo:hi].transpose(0, 1).float()  # [Hkv, n, D]
        v_t = values[lo:hi].transpose(0, 1).float()
        scores = torch.matmul(q_t, k_t.transpose(1, 2)) * scale  # [Hkv, G, n]
        probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.matmul(probs, v_t).reshape(q.shape[1], q.shape[2]))
    return torch.stack(outputs).to(q.dtype)


def attend_masked(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [..., T, H, D]; keys/values [..., L, Hkv, D]; visible bool [T, L] or [..., T, L].

    Returns [..., T, H, D]; leading dims (sequences) are computed in one call.
    """
    group = q.shape[-2] // keys.shape[-2]
    k = keys.repeat_interleave(group, dim=-2).transpose(-3, -2)  # [..., H, L, D]
    v = values.repeat_interleave(group, dim=-2).transpose(-3, -2)
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k, v, attn_mask=visible.unsqueeze(-3), scale=scale
    )
    return out.transpose(-3, -2)


def attend_all(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attend_masked` with every key visible, for one sequence: q [T, H, D]; keys/values
    [L, Hkv, D] → [T, H, D] in q's dtype, softmax in fp32. The query heads of a kv head go
    through one matmul together, so keys and values are never repeated per query head (on
    the CPU half the time of SDPA with repeated keys: a draft's non-causal layers)."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = _grouped(q, num_kv_heads).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, dim)
    scores = torch.bmm(grouped, keys.permute(1, 2, 0)) * scale  # [Hkv, T·G, L]
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.bmm(probs, values.transpose(0, 1))  # [Hkv, T·G, D]
    out = out.reshape(num_kv_heads, num_tokens, num_heads // num_kv_heads, dim)
    return out.permute(1, 0, 2, 3).reshape(num_tokens, num_heads, dim).to(q.dtype)


def attend_causal(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attend_masked` for new tokens that are the last T of the L keys, each seeing the keys
    up to its own (a prompt chunk after L − T cached tokens): q [B, T, H, D]; keys/values
    [B, L, Hkv, D] → [B, T, H, D].

    The causal pattern is given as "lower right" rather than as a [T, L] mask, and the key
    heads are shared by their query groups instead of repeated: on a GPU that lets SDPA take
    its flash kernel, which skips the masked half, where a mask keeps it on a kernel that
    reads the mask and every repeated key (measured on an H200 for an 8192-token prompt).
    The flash kernel needs a GPU and half precision; elsewhere (the CPU, an fp32 model) the
    bias would be materialised for the math backend with every score, so the mask is used.
    """
    num_new, num_keys = q.shape[1], keys.shape[1]
    if not (q.is_cuda and q.dtype in FLASH_DTYPES):
        positions = torch.arange(num_keys, device=q.device)
        visible = positions[None, :] <= positions[num_keys - num_new :, None]
        return attend_masked(q, keys, values, visible, scale)
    with sdpa_kernel(PREFILL_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=causal_lower_right(num_new, num_keys),
            scale=scale,
            enable_gqa=True,
        )
    return out.transpose(1, 2)
