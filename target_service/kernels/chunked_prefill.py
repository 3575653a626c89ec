"""A prompt's gated delta rule in chunks on fla-core's Triton kernels (the WY form), for prefill.

The verify recurrence (`gated_delta_recurrence`) goes token by token: right for 16-token
blocks, slow for a long prompt (one sequential step per token). fla-core's
`chunk_gated_delta_rule` solves 64 tokens at a time with matrix products. Its summation order
differs from the token-by-token rule, so it agrees with it to rounding, not bit for bit;
prefill is shared by speculative and plain decoding, so their equality does not depend on it.
fla-core is an optional GPU dependency (the `gpu` extra): without it prefill keeps the
token-by-token kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ChunkRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def load_chunk_rule() -> ChunkRule | None:
    """fla-core's chunked gated delta rule, or None where fla-core is not installed (said
    once in the log: prefill still works, at half the speed on long prompts)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        warn_token_by_token_prefill()
        return None
    return chunk_gated_delta_rule


@functools.cache
def warn_token_by_token_prefill() -> None:
    """Once a process: every GDN layer asks for the rule, one warning is enough."""
    logger.warning(
        "fla-core is not installed: GPU prefill runs the GDN recurrence token by token "
        "(about 2x slower on an 8192-token prompt); install the gpu extra "
        "(pip install 'dflash-serve[gpu]') for chunked prefill"
    )


def chunked_prefill(
    chunk_rule: ChunkRule,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `recurrent_gated_delta` over a prefill chunk: q, k raw (before the
    L2 norm) [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log decay) and beta [B, T, Hv] fp32; pool
    fp32 [slots, Hv, Dk, Dv], read at `slots` and updated in place. Returns outputs
    [B, T, Hv, Dv] in the rule's output dtype (fla's: v's), not widened to fp32: the layer
    casts them to the activations' dtype next, so widening was a copy there and back. Value
    head h reads key head h // (Hv / Hk), as fla's GVA does; the state layout [.., Dk, Dv] is
    asked for explicitly (Dk = Dv for Qwen3.5, so a transposed state would raise nothing)."""
    initial = pool[slots]
    out, final = chunk_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), scale=q.shape[-1] ** -0.5, initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=False,
    )  # fmt: skip
    pool[slots] = final.float()
    return out
