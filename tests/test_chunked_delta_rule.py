"""The chunked (prefill) gated delta rule against the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch

from target_service.model.chunked_delta_rule import chunked_gated_delta_rule
from target_service.model.delta_rule import gated_delta_rule


def random_inputs(batch, tokens, heads, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(batch, tokens, heads, dk, generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(batch, tokens, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, tokens, heads, dv, generator=gen)
    g = -torch.rand(batch, tokens, heads, generator=gen) * 2  # log decay in (-2, 0]
    beta = torch.rand(batch, tokens, heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return q * dk**-0.5, k, v, g, beta, state


@pytest.mark.parametrize(
    ("tokens", "chunk"), [(1, 64), (5, 4), (64, 64), (130, 64), (97, 16), (200, 32)]
)
def test_chunked_matches_recurrent_outputs_and_final_state(tokens, chunk):
    inputs = random_inputs(2, tokens, 3, 8, 12, seed=tokens)
    expected_out, expected_state = gated_delta_rule(*inputs)
    out, state = chunked_gated_delta_rule(*inputs, chunk_tokens=chunk)
    # Same maths, different summation order: fp32 rounding only (measured up to ~2e-6).
    torch.testing.assert_close(out, expected_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_initial_state_is_not_modified():
    inputs = random_inputs(1, 10, 2, 4, 4, seed=1)
    before = inputs[-1].clone()
    chunked_gated_delta_rule(*inputs, chunk_tokens=4)
    assert torch.equal(inputs[-1], before)
