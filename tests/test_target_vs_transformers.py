"""Our Qwen3.5 target against transformers' own classes on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch

from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from tests.tiny_checkpoints import load_oracle

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8, 150, 3, 44, 61, 12]
TAPS = (0, 1, 3)
# Prefill: same maths, different summation order (transformers runs the chunked delta rule,
# we run it token by token): measured ~3e-6 on logits of magnitude ~5 and ~1e-4 on tapped
# hidden states of magnitude up to ~4 (relative ~3e-5).
PREFILL_ATOL = 1e-4
PREFILL_RTOL = 1e-4
# Decoding: the prefill gap propagates through 64 recurrent steps; measured up to ~5e-4.
DECODE_ATOL = 2e-3


@pytest.fixture(params=["causal_lm_dir", "conditional_generation_dir"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def make_engine(path, chunk_tokens=512):
    model = load_target_model(path)
    return TargetEngine(model, StateShape(max_slots=2, max_len=256), TAPS, chunk_tokens)


def test_prefill_logits_and_taps_match(checkpoint):
    engine = make_engine(checkpoint, chunk_tokens=5)  # 13 tokens → three chunks
    slot = engine.open_sequence()
    result = engine.prefill(slot, PROMPT)
    with torch.no_grad():
        ref = load_oracle(checkpoint)(torch.tensor([PROMPT]), output_hidden_states=True)
    torch.testing.assert_close(
        result.last_logits, ref.logits[0, -1], atol=PREFILL_ATOL, rtol=PREFILL_RTOL
    )
    expected_taps = torch.cat([ref.hidden_states[i + 1][0] for i in TAPS], dim=-1)
    torch.testing.assert_close(result.taps, expected_taps, atol=PREFILL_ATOL, rtol=PREFILL_RTOL)
    assert engine.length(slot) == len(PROMPT)


def test_64_greedy_steps_match(checkpoint):
    oracle = load_oracle(checkpoint)
    ref = oracle.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=64,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    engine = make_engine(checkpoint)
    slot = engine.open_sequence()
    logits = engine.prefill(slot, PROMPT).last_logits
    tokens = []
    for step in range(64):
        torch.testing.assert_close(logits, ref.logits[step][0], atol=DECODE_ATOL, rtol=0)
        tokens.append(int(logits.argmax()))
        logits = engine.verify([slot], [[tokens[-1]]]).logits[0, 0]
        engine.commit(slot, 1)
    assert tokens == ref.sequences[0, len(PROMPT) :].tolist()


def test_untied_head_is_loaded(tmp_path):
    from tests.tiny_checkpoints import write_causal_lm

    path = write_causal_lm(tmp_path, seed=3, tie_word_embeddings=False)
    engine = make_engine(path)
    slot = engine.open_sequence()
    result = engine.prefill(slot, PROMPT)
    with torch.no_grad():
        ref = load_oracle(path)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(result.last_logits, ref, atol=PREFILL_ATOL, rtol=PREFILL_RTOL)
    assert not torch.equal(engine.model.head_weight, engine.model.embed_tokens.weight)
