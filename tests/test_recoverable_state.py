"""verify + commit(n) must leave exactly the state that feeding the n tokens directly leaves.

Compared bit for bit (torch.equal) in fp32 on the CPU: any rejected-draft residue in the KV
cache, the conv state or the recurrent state changes later logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from target_service.engine import TargetEngine
from target_service.model.forward_batch import ForwardBatch
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape, TargetState

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


@pytest.fixture(scope="module")
def model(causal_lm_dir):
    return load_target_model(causal_lm_dir)


def new_engine(model, max_slots=4):
    return TargetEngine(model, StateShape(max_slots=max_slots, max_len=512), tap_layer_ids=(2,))


def decode(engine, slot, tokens):
    """Feed tokens one at a time (plain decoding); return the logits after each."""
    out = []
    for token in tokens:
        out.append(engine.verify([slot], [[token]]).logits[0, 0])
        engine.commit(slot, 1)
    return torch.stack(out)


def random_tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("num_kept", range(1, 17))
def test_commit_prefix_equals_direct_feeding(model, num_kept):
    rng = random.Random(num_kept)
    vocab = model.config.vocab_size
    block = random_tokens(rng, 16, vocab)
    continuation = random_tokens(rng, 6, vocab)

    speculative = new_engine(model)
    slot = speculative.open_sequence()
    speculative.prefill(slot, PROMPT)
    block_logits = speculative.verify([slot], [block]).logits[0]
    speculative.commit(slot, num_kept)
    after_commit = decode(speculative, slot, continuation)

    direct_block = new_engine(model)
    slot_b = direct_block.open_sequence()
    direct_block.prefill(slot_b, PROMPT)
    prefix_logits = direct_block.verify([slot_b], [block[:num_kept]]).logits[0]
    direct_block.commit(slot_b, num_kept)
    assert torch.equal(block_logits[:num_kept], prefix_logits)
    assert torch.equal(after_commit, decode(direct_block, slot_b, continuation))

    one_by_one = new_engine(model)
    slot_c = one_by_one.open_sequence()
    one_by_one.prefill(slot_c, PROMPT)
    assert torch.equal(block_logits[:num_kept], decode(one_by_one, slot_c, block[:num_kept]))
    assert torch.equal(after_commit, decode(one_by_one, slot_c, continuation))
    for name in ("recurrent_state", "conv_state"):
        assert torch.equal(
            getattr(speculative.state, name)[:, slot], getattr(one_by_one.state, name)[:, slot_c]
        ), name


def test_keeping_a_whole_padded_block_replays_instead_of_adopting_the_final_state(model):
    """A short block padded to a graph's length ran 16 tokens in its forward; keeping all 5
    of its own must replay them, not adopt the state after 16 (simulated on the CPU: a
    16-token verify, then the block size the padded path records)."""
    rng = random.Random(99)
    block = random_tokens(rng, 16, model.config.vocab_size)
    padded, short = new_engine(model), new_engine(model)
    slots = {engine: engine.open_sequence() for engine in (padded, short)}
    for engine, slot in slots.items():
        engine.prefill(slot, PROMPT)
    padded.verify([slots[padded]], [block])
    padded.state.block_sizes[slots[padded]] = 5  # block_run_sizes stays 16
    padded.commit(slots[padded], 5)
    short.verify([slots[short]], [block[:5]])
    short.commit(slots[short], 5)
    for name in ("recurrent_state", "conv_state"):
        assert torch.equal(
            getattr(padded.state, name)[:, slots[padded]],
            getattr(short.state, name)[:, slots[short]],
        ), name
    continuation = random_tokens(rng, 4, model.config.vocab_size)
    assert torch.equal(
        decode(padded, slots[padded], continuation), decode(short, slots[short], continuation)
    )


def test_blocks_of_different_lengths_share_one_verify_bit_for_bit(model):
    """One verify of blocks of 5, 16 and 1 tokens (padded to 16 inside) gives each block's
    rows of its own verify, and commits of each leave the same states."""
    rng = random.Random(7)
    vocab = model.config.vocab_size
    blocks = [random_tokens(rng, n, vocab) for n in (5, 16, 1)]
    kept = (3, 16, 1)
    shared, alone = new_engine(model), new_engine(model)
    slots = {engine: [engine.open_sequence() for _ in blocks] for engine in (shared, alone)}
    for engine, engine_slots in slots.items():
        for slot, prompt_length in zip(engine_slots, (11, 7, 9), strict=True):
            engine.prefill(slot, PROMPT[:prompt_length])
    together = shared.verify(slots[shared], blocks)
    for row, (block, num_kept) in enumerate(zip(blocks, kept, strict=True)):
        own = alone.verify([slots[alone][row]], [block])
        assert torch.equal(together.logits[row, : len(block)], own.logits[0])
        assert torch.equal(together.taps[row, : len(block)], own.taps[0])
        alone.commit(slots[alone][row], num_kept)
        shared.commit(slots[shared][row], num_kept)
    continuation = random_tokens(rng, 3, vocab)
    for a, b in zip(slots[shared], slots[alone], strict=True):
        assert torch.equal(decode(shared, a, continuation), decode(alone, b, continuation))


class EagerVerifyGraphs:
    """Stands in for VerifyGraphs on the CPU: 'captured' for 16-token blocks only, replayed
    by running the same forward eagerly (what a graph replays)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.keys = []

    def run_length(self, batch_size: int, num_tokens: int) -> int:
        return 16

    def replay(self, slots, starts, block_ids):
        engine = self.engine
        self.keys.append((len(slots), len(block_ids[0])))
        batch = ForwardBatch(tuple(slots), starts, len(block_ids[0]), is_verify=True)
        ids = torch.tensor(block_ids)
        hidden, taps = engine.model(ids, batch.on_device("cpu"), engine.state, engine.tap_layer_ids)
        return engine.model.logits(hidden), taps


def test_short_blocks_run_in_a_longer_graph_padded_bit_for_bit(model):
    """The engine's graph path: blocks of 5 and 3 tokens run as one 16-token graph replay,
    their rows and the states their commits leave equal an engine without graphs."""
    rng = random.Random(11)
    vocab = model.config.vocab_size
    blocks = [random_tokens(rng, 5, vocab), random_tokens(rng, 3, vocab)]
    graphed, plain = new_engine(model), new_engine(model)
    graphed.graphs = EagerVerifyGraphs(graphed)
    slots = {engine: [engine.open_sequence() for _ in blocks] for engine in (graphed, plain)}
    for engine, engine_slots in slots.items():
        for slot in engine_slots:
            engine.prefill(slot, PROMPT)
    results = {engine: engine.verify(slots[engine], blocks) for engine in (graphed, plain)}
    assert graphed.graphs.keys == [(2, 16)]
    assert [graphed.state.block_run_sizes[s] for s in slots[graphed]] == [16, 16]
    assert torch.equal(results[graphed].logits, results[plain].logits)
    assert torch.equal(results[graphed].taps, results[plain].taps)
    continuation = random_tokens(rng, 3, vocab)
    for row, num_kept in enumerate((5, 2)):  # all of the first block, part of the second
        after = []
        for engine in (graphed, plain):
            engine.commit(slots[engine][row], num_kept)
            after.append(decode(engine, slots[engine][row], continuation))
        assert torch.equal(after[0], after[1])


def test_hundred_rejections_never_drift(model):
    rng = random.Random(7)
    vocab = model.config.vocab_size
    speculative, plain = new_engine(model), new_engine(model)
    slot_s, slot_p = speculative.open_sequence(), plain.open_sequence()
    speculative.prefill(slot_s, PROMPT)
    plain.prefill(slot_p, PROMPT)
    for _ in range(100):
        block = random_tokens(rng, 16, vocab)
        logits_s = speculative.verify([slot_s], [block]).logits[0, 0]
        speculative.commit(slot_s, 1)
        assert torch.equal(logits_s, decode(plain, slot_p, block[:1])[0])
    assert torch.equal(
        speculative.state.recurrent_state[:, slot_s], plain.state.recurrent_state[:, slot_p]
    )


def test_batch_with_different_commits_stays_exact(model):
    rng = random.Random(11)
    vocab = model.config.vocab_size
    prompts = [PROMPT, PROMPT[:4], random_tokens(rng, 23, vocab)]
    kept = [[3, 16, 1], [1, 7, 16], [9, 2, 5]]  # per round, per sequence
    batched = new_engine(model)
    slots = [batched.open_sequence() for _ in prompts]
    solo = [new_engine(model) for _ in prompts]
    solo_slots = [e.open_sequence() for e in solo]
    for slot, engine, solo_slot, prompt in zip(slots, solo, solo_slots, prompts, strict=True):
        batched.prefill(slot, prompt)
        engine.prefill(solo_slot, prompt)
    for round_kept in kept:
        blocks = [random_tokens(rng, 16, vocab) for _ in prompts]
        logits = batched.verify(slots, blocks).logits
        batched.commit_many(slots, round_kept)  # one commit for the batch, as a step does
        for i, n in enumerate(round_kept):
            alone = decode(solo[i], solo_slots[i], blocks[i][:n])
            assert torch.equal(logits[i, :n], alone), (i, n)
    probe = [random_tokens(rng, 1, vocab) for _ in prompts]
    final = batched.verify(slots, probe).logits[:, 0]
    for i, engine in enumerate(solo):
        assert torch.equal(final[i], engine.verify([solo_slots[i]], [probe[i]]).logits[0, 0])


def recorded_block_state(model, seed):
    """A state whose four slots hold random committed GDN state and random recorded blocks
    (of 16 tokens; slot 3's forward ran 16 but its block has 12, as a padded graph leaves)."""
    state = new_engine(model).state
    generator = torch.Generator().manual_seed(seed)
    for name in ("conv_state", "recurrent_state", "block_final_state", "block_conv_inputs",
                 "block_keys", "block_values", "block_betas"):  # fmt: skip
        tensor = getattr(state, name)
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    state.block_decays.copy_(-torch.rand(state.block_decays.shape, generator=generator))
    state.block_sizes[:] = [16, 16, 16, 12]
    state.block_run_sizes[:] = [16] * 4
    return state


def clone_state(state):
    copy = TargetState.__new__(TargetState)
    for name, value in vars(state).items():
        setattr(copy, name, value.clone() if isinstance(value, torch.Tensor) else list(value)
                if isinstance(value, list) else value)  # fmt: skip
    return copy


def assert_same_state(got, want, context=None) -> None:
    """Every attribute of two TargetStates equal, tensors bit for bit."""
    for name, value in vars(want).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(got, name), value), (context, name)
        else:
            assert getattr(got, name) == value, (context, name)


@pytest.mark.parametrize("with_kernel", [False, True])
def test_one_commit_for_a_batch_equals_one_per_slot(model, with_kernel):
    """commit_blocks over several slots (whole blocks, replayed prefixes of different
    lengths, the slots in any order) leaves every tensor as committing each slot alone.
    The two take different code (gathers by slot and per-row replay counts for a batch,
    views of one slot's rows alone), so each checks the other."""
    from target_service.kernels.gated_delta_recurrence import recurrent_gated_delta
    from target_service.model.commit import commit_blocks

    kernel = recurrent_gated_delta if with_kernel else None
    together = recorded_block_state(model, seed=3)
    one_by_one = clone_state(together)
    slots, kept = [2, 0, 3, 1], [5, 16, 12, 1]
    commit_blocks(together, slots, kept, kernel)
    for slot, n in zip(slots, kept, strict=True):
        commit_blocks(one_by_one, [slot], [n], kernel)
    assert_same_state(together, one_by_one)
    # And it did something: whole blocks take the final state, others a replayed one.
    fresh = recorded_block_state(model, seed=3)
    assert torch.equal(together.recurrent_state[:, 0], fresh.block_final_state[:, 0])
    assert not torch.equal(together.recurrent_state[:, 2], fresh.recurrent_state[:, 2])
    assert not torch.equal(together.recurrent_state[:, 2], fresh.block_final_state[:, 2])
    assert together.lengths == [16, 1, 5, 12]


def test_commit_many_checks_every_slot_before_committing_any(model):
    from dflash_serve.errors import InvalidRequestError

    engine = new_engine(model)
    slots = [engine.open_sequence() for _ in range(2)]
    for slot in slots:
        engine.prefill(slot, PROMPT)
    engine.verify(slots, [[1, 2, 3], [4, 5]])
    before = clone_state(engine.state)
    for bad_kept, message in (([1, 3], r"num_kept must be in 1\.\.2"), ([0, 1], "1..3")):
        with pytest.raises(InvalidRequestError, match=message):
            engine.commit_many(slots, bad_kept)
    with pytest.raises(InvalidRequestError, match="distinct slots"):
        engine.commit_many([slots[0], slots[0]], [1, 1])
    assert_same_state(engine.state, before)
    engine.commit_many(slots, [3, 2])
    assert [engine.length(s) for s in slots] == [len(PROMPT) + 3, len(PROMPT) + 2]


def per_slot_bytes(state):
    """Bytes of every state tensor that belongs to one slot, by attribute name."""
    return {
        name: value[:, 0].nbytes
        for name, value in vars(state).items()
        if isinstance(value, torch.Tensor)
    }


def test_state_holds_at_most_two_recurrent_states_per_sequence():
    from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT
    from dflash_serve.qwen35_config import Qwen35TextConfig

    config = Qwen35TextConfig.from_dict(QWEN35_4B_TEXT)
    state = TargetState(config, StateShape(max_slots=2, max_len=8192), torch.bfloat16, "meta")
    sizes = per_slot_bytes(state)
    one_recurrent = 24 * 32 * 128 * 128 * 4  # 24 GDN layers, fp32: 48 MiB
    kv_per_token = 8 * 2 * 4 * 256 * 2  # 8 attention layers, K and V, bf16: 32 KiB
    assert sizes["recurrent_state"] == one_recurrent
    # max_len plus one block of room for a block padded to a CUDA graph's length
    assert sizes["key_cache"] + sizes["value_cache"] == kv_per_token * (8192 + 16)
    everything_else = sum(sizes.values()) - sizes["key_cache"] - sizes["value_cache"]
    # Two recurrent states (96 MiB) plus the conv state (1.2 MiB) and 16 tokens of block
    # inputs for replay (~18 MiB); a per-draft-position scheme would need 16 recurrent
    # states (768 MiB).
    assert 2 * one_recurrent < everything_else < 2.5 * one_recurrent


def test_commit_validates_its_arguments(model):
    from dflash_serve.errors import InvalidRequestError

    engine = new_engine(model)
    slot = engine.open_sequence()
    engine.prefill(slot, PROMPT)
    with pytest.raises(InvalidRequestError, match="without a verified block"):
        engine.commit(slot, 1)
    engine.verify([slot], [[1, 2, 3]])
    with pytest.raises(InvalidRequestError, match=r"num_kept must be in 1\.\.3"):
        engine.commit(slot, 4)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.verify([slot], [[model.config.vocab_size]])
