"""Prompts prefilled padded to a run length (`prefill_run_tokens`, the prefill graphs' shapes).

The reference is the same engine without run lengths: the prompt prefilled at its own length.
Padding sits after the prompt, so every real row's inputs are the reference's; what padding
could change is the state a later token reads (GDN recurrent and conv states, the prompt's
keys), the last logits (the last real row, not the last row) and the taps. Matmuls of another
row count may round differently (the conv state and keys copy projections too), so float
results are compared with a tolerance far below what a padding token's update or a wrong row
would change (checked by `test_..._can_fail`); the tokens decoded afterwards must be equal.
"""

from __future__ import annotations

import pytest
import torch

from target_service.engine import TargetEngine
from target_service.model.state import StateShape
from tests.prefill_checks import greedy_tokens, record_padded_forwards

TAP = 1
MAX_LEN = 96
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7 * i % 97 + 1 for i in range(32)], [5])


def new_engine(model, prefill_run_tokens=()):
    shape = StateShape(max_slots=2, max_len=MAX_LEN)
    return TargetEngine(model, shape, (TAP,), prefill_run_tokens=prefill_run_tokens)


def prefill_both(model, prompt, run_tokens):
    """(engine, slot, result) with the run lengths and without; the padded engine's forward
    is checked to have run at the shortest run length that holds the prompt."""
    padded, plain = new_engine(model, run_tokens), new_engine(model)
    results = []
    with pytest.MonkeyPatch.context() as patch:
        forwards = record_padded_forwards(patch)
        for engine in (padded, plain):
            slot = engine.open_sequence()
            results.append((engine, slot, engine.prefill(slot, prompt)))
    assert forwards == [(1, min(t for t in run_tokens if t >= len(prompt)))]
    return results


def assert_same_prefill(model, prompt, run_tokens, atol):
    (padded, slot, result), (plain, plain_slot, expected) = prefill_both(model, prompt, run_tokens)
    assert padded.length(slot) == len(prompt)
    torch.testing.assert_close(result.last_logits, expected.last_logits, atol=atol, rtol=0)
    assert result.taps.shape == expected.taps.shape == (len(prompt), model.config.hidden_size)
    torch.testing.assert_close(result.taps, expected.taps, atol=atol, rtol=0)
    state, reference = padded.state, plain.state
    torch.testing.assert_close(
        state.conv_state[:, slot], reference.conv_state[:, plain_slot], atol=atol, rtol=0
    )
    torch.testing.assert_close(
        state.recurrent_state[:, slot],
        reference.recurrent_state[:, plain_slot],
        atol=atol,
        rtol=0,
    )
    prompt_keys = state.key_cache[:, slot, : len(prompt)]
    torch.testing.assert_close(
        prompt_keys, reference.key_cache[:, plain_slot, : len(prompt)], atol=atol, rtol=0
    )
    first = int(expected.last_logits.argmax())
    assert greedy_tokens(padded, slot, first, 6) == greedy_tokens(plain, plain_slot, first, 6)


@pytest.mark.parametrize("prompt", PROMPTS, ids=len)
def test_padded_prefill_equals_the_prompt_alone_on_the_reference_path(reference_model, prompt):
    assert_same_prefill(reference_model, prompt, (16, 32, 64), atol=1e-5)


def test_padded_prefill_equals_the_prompt_alone_on_the_kernel_path(cpu_kernel_model):
    assert_same_prefill(cpu_kernel_model, PROMPTS[0], (16,), atol=2e-2)


def test_padding_without_its_mask_would_change_the_state_so_the_check_can_fail(
    reference_model, monkeypatch
):
    """The tolerances above are far below what one padding token's update changes: with the
    padding counted as prompt (valid_tokens dropped) the same comparison fails."""
    from target_service.model import forward_batch

    monkeypatch.setattr(forward_batch.ForwardBatch, "real_rows", lambda self, device: None)
    with pytest.raises(AssertionError):
        assert_same_prefill(reference_model, PROMPTS[0], (64,), atol=1e-5)


def test_run_lengths_apply_from_position_0_and_within_max_len(reference_model):
    engine = new_engine(reference_model, (16, 64, 128))
    assert engine.prefill_run_tokens == (16, 64)  # 128 > max_len
    slot = engine.open_sequence()
    assert engine.prefill_run_length(slot, 5) == 16
    assert engine.prefill_run_length(slot, 17) == 64
    assert engine.prefill_run_length(slot, 65) is None  # eager chunks
    engine.prefill(slot, PROMPTS[0])
    assert engine.prefill_run_length(slot, 5) is None  # not from position 0
    more = engine.prefill(slot, [9, 8, 7])  # a continued prompt: eager, and still right
    plain = new_engine(reference_model)
    plain_slot = plain.open_sequence()
    plain.prefill(plain_slot, PROMPTS[0])
    expected = plain.prefill(plain_slot, [9, 8, 7])
    torch.testing.assert_close(more.last_logits, expected.last_logits, atol=1e-5, rtol=0)
    assert engine.length(slot) == len(PROMPTS[0]) + 3


def test_a_prompt_that_fills_max_len_pads_within_the_cache(reference_model):
    prompt = [(3 * i) % 200 + 1 for i in range(MAX_LEN - 1)]
    engine = new_engine(reference_model, (MAX_LEN,))
    slot = engine.open_sequence()
    result = engine.prefill(slot, prompt)
    plain = new_engine(reference_model)
    expected = plain.prefill(plain.open_sequence(), prompt)
    torch.testing.assert_close(result.last_logits, expected.last_logits, atol=1e-5, rtol=0)


def test_the_target_flag_sets_the_graph_lengths_and_rejects_bad_ones():
    from dflash_serve.errors import ConfigError
    from launcher.main import build_parser
    from target_service.config import DEFAULT_PREFILL_GRAPH_TOKENS, TargetServiceConfig

    def graph_tokens(*flags):
        return build_parser().parse_args(["target", "--model", "m", *flags]).prefill_graph_tokens

    assert graph_tokens() == DEFAULT_PREFILL_GRAPH_TOKENS
    assert graph_tokens("--prefill-graph-tokens", "64,512") == (64, 512)
    assert graph_tokens("--prefill-graph-tokens", "") == ()
    with pytest.raises(SystemExit):
        graph_tokens("--prefill-graph-tokens", "64,lots")
    with pytest.raises(ConfigError, match="prefill_graph_tokens"):
        TargetServiceConfig(model="m", prefill_graph_tokens=(64, 0)).validate()


def test_the_target_flag_sets_the_shared_prefill_rows():
    from dflash_serve.errors import ConfigError
    from launcher.main import build_parser
    from target_service.config import DEFAULT_PREFILL_BATCH_ROWS, TargetServiceConfig

    def batch_rows(*flags):
        return build_parser().parse_args(["target", "--model", "m", *flags]).prefill_batch_rows

    assert batch_rows() == DEFAULT_PREFILL_BATCH_ROWS
    assert batch_rows("--prefill-batch-rows", "512") == 512
    with pytest.raises(ConfigError, match="prefill_batch_rows"):
        TargetServiceConfig(model="m", prefill_batch_rows=0).validate()
