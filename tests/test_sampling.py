"""The target's seeded sampling: a pure function of (seed, position), with the right law."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.sampling import (
    choose_block_tokens,
    choose_tokens,
    filter_logits,
    uniform_noise,
)
from dflash_serve.speculative.types import SamplingParams

DRAWS = 20_000


def test_noise_depends_only_on_seed_position_and_token():
    together = uniform_noise(42, torch.tensor([3, 9, 10]), 300)
    alone = uniform_noise(42, torch.tensor([9]), 300)
    assert torch.equal(together[1], alone[0])
    assert not torch.equal(together[1], together[2])
    assert not torch.equal(uniform_noise(43, torch.tensor([9]), 300), alone)
    assert together.min() > 0.0 and together.max() < 1.0


def test_noise_is_the_hash_of_seed_position_and_token():
    """The seed's key is hashed on the host; the values are those of hashing it as an int64
    tensor (written out here), for seeds below and above 2^32."""
    mask, salts = 0xFFFFFFFF, (0x2545F491, 0x3C6EF372)

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & mask
        x = x ^ (x >> 15)
        x = (x * 0x5BD1E995) & mask
        return x ^ (x >> 16)

    positions = torch.tensor([0, 5, 4096])
    for seed in (0, 77, 2**40 + 3):
        key = mix(mix(torch.tensor(seed & mask) ^ salts[0]) ^ (seed >> 32))
        per_position = mix(key ^ ((positions * salts[1]) & mask))
        bits = mix(mix(per_position[:, None] ^ torch.arange(300)) ^ per_position[:, None])
        assert torch.equal(uniform_noise(seed, positions, 300), (bits.double() + 0.5) / 2.0**32)


def test_a_position_draws_the_same_token_alone_or_in_a_block():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=77)
    positions = torch.arange(100, 116)
    block = choose_tokens(logits, positions, params)
    singles = [
        int(choose_tokens(logits[i : i + 1], positions[i : i + 1], params)) for i in range(16)
    ]
    assert block.tolist() == singles


@pytest.mark.parametrize("all_greedy", [True, False])
def test_a_batch_of_blocks_chooses_what_each_block_alone_would(all_greedy):
    """Blocks of different lengths (padding rows after each) and, mixed in, sampled rows
    with their own seeds: the batch's tokens are each block's own choose_tokens."""
    logits = torch.randn(4, 16, 500, generator=torch.Generator().manual_seed(1))
    starts, lengths = [7, 100, 0, 33], [16, 3, 1, 9]
    greedy = SamplingParams(temperature=0.0)
    params = [greedy] * 4
    if not all_greedy:
        params[1] = SamplingParams(temperature=0.8, top_k=50, seed=5)
        params[3] = SamplingParams(temperature=1.2, top_p=0.9, seed=6)
    first_rows = [0, 0, 0, 8]  # block 3 needs only its last row, as a prompt block
    chosen = choose_block_tokens(logits, starts, lengths, params, first_rows)
    for b in range(4):
        first = first_rows[b]
        positions = torch.arange(starts[b] + 1 + first, starts[b] + 1 + lengths[b])
        alone = choose_tokens(logits[b, first : lengths[b]], positions, params[b])
        assert chosen[b] == alone.tolist(), b
    if not all_greedy:  # the sampled rows really sampled (a draw differing from argmax)
        assert chosen[1] != logits[1, :3].argmax(dim=-1).tolist()
        assert len(chosen[3]) == 1


def test_sampling_follows_the_softmax_law():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).repeat(DRAWS, 1)
    for temperature in (1.0, 0.5):
        params = SamplingParams(temperature=temperature, seed=5)
        tokens = choose_tokens(logits, torch.arange(DRAWS), params)
        observed = torch.bincount(tokens, minlength=4).double() / DRAWS
        expected = torch.softmax(logits[0].double() / temperature, dim=0)
        # Binomial standard error at 20k draws is ≤ 0.0036; 0.015 is four of them.
        assert (observed - expected).abs().max() < 0.015, (temperature, observed, expected)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]).repeat(DRAWS, 1)
    top_k = choose_tokens(logits, torch.arange(DRAWS), SamplingParams(1.0, top_k=2, seed=1))
    assert set(top_k.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], 0)  # 0.636, 0.234, 0.086, ...
    top_p = SamplingParams(1.0, top_p=0.8, seed=2)
    assert probs[0] < 0.8 < probs[0] + probs[1]
    kept = torch.isfinite(filter_logits(logits[:1], top_p))[0].tolist()
    assert kept == [True, True, False, False, False]
    assert set(choose_tokens(logits, torch.arange(DRAWS), top_p).tolist()) == {0, 1}


def test_greedy_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    tokens = choose_tokens(logits, torch.arange(8), SamplingParams())
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(seed=-1), "seed"),
    ],
)
def test_invalid_parameters_are_named(params, field):
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()
