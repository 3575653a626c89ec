"""What the prefill tests share: comparing two prefills bit for bit, decoding after one, and
recording the shapes of the padded prefill forwards."""

from __future__ import annotations

import torch

from target_service import prefill_graphs


def record_padded_forwards(monkeypatch) -> list[tuple[int, int]]:
    """The (prompts, run length) of every padded prefill forward from now on, in order."""
    shapes = []
    forward = prefill_graphs.padded_prefill

    def spy(model, state, taps, inputs):
        shapes.append((inputs.shape[1], inputs.shape[0] - 2))
        return forward(model, state, taps, inputs)

    monkeypatch.setattr(prefill_graphs, "padded_prefill", spy)
    return shapes


def assert_same_prefill_bits(engine, slot, result, other, other_slot, expected, num_tokens):
    """The prefill of `num_tokens` on (engine, slot) gave `result` and on (other, other_slot)
    `expected`: the same last logits and taps, and the same state for later tokens to read
    (GDN recurrent and conv states, the prompt's keys), bit for bit."""
    assert engine.length(slot) == other.length(other_slot) == num_tokens
    assert torch.equal(result.last_logits, expected.last_logits)
    assert torch.equal(result.taps, expected.taps)
    for name in ("recurrent_state", "conv_state"):
        mine, theirs = getattr(engine.state, name), getattr(other.state, name)
        assert torch.equal(mine[:, slot], theirs[:, other_slot]), name
    keys = engine.state.key_cache[:, slot, :num_tokens]
    assert torch.equal(keys, other.state.key_cache[:, other_slot, :num_tokens])


def greedy_tokens(engine, slot, first_token, count):
    """Plain greedy decoding from `first_token`: it and the `count` tokens after it."""
    tokens = [first_token]
    for _ in range(count):
        tokens.append(int(engine.verify([slot], [[tokens[-1]]]).logits[0, 0].argmax()))
        engine.commit(slot, 1)
    return tokens


def assert_each_as_alone(engine, slots, prompts, results, new_alone_engine, num_decoded):
    """Each prompt's prefill result on `engine` (and the greedy tokens decoded after it) has
    the bits of the prompt prefilled alone on a fresh engine from `new_alone_engine()`."""
    for slot, prompt, result in zip(slots, prompts, results, strict=True):
        alone = new_alone_engine()
        alone_slot = alone.open_sequence()
        expected = alone.prefill(alone_slot, prompt)
        assert_same_prefill_bits(engine, slot, result, alone, alone_slot, expected, len(prompt))
        first = int(expected.last_logits.argmax())
        decoded = greedy_tokens(engine, slot, first, num_decoded)
        assert decoded == greedy_tokens(alone, alone_slot, first, num_decoded)
