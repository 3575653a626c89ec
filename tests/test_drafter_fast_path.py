"""The drafter's GPU fast path (block-attention kernel over the cache, CUDA graphs of the draft).

The kernel path must give the plain-torch path's draft logits (up to bf16 rounding of a
different summation order), whatever the layer's causal and window rules, and its scratch
block keys must never be read as context. On a GPU, a replayed graph must give the eager
kernel path's drafts bit for bit. Without a GPU the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.checkpoint.synthetic import write_drafter
from drafter_service.context_graphs import ContextGraphs
from drafter_service.engine import DrafterEngine
from drafter_service.model.loader import load_drafter
from tests.tiny_checkpoints import dflash_config_dict, write_causal_lm

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HIDDEN = 64
VOCAB = 256
# Heads the kernel tiles (head dims powers of two >= 16). Sliding windows of 6 are smaller than
# every context below but one, so the window matters; under the reference rule (is_causal
# unset) the sliding layers are causal and the full layer is not.
VARIANTS = {
    "reference_rule": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "none_causal_group_4": dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, is_causal=False
    ),
    "all_causal": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, is_causal=True),
}
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention")
# Context lengths of the sequences: one shorter than the window, two longer.
CONTEXTS = (11, 3, 37)
ANCHORS = (5, 77, 200)
MAX_LEN = 64
# bf16 tolerance: the two paths round bf16 activations after differently ordered sums (the
# kernel's online softmax rounds P to bf16 before P·V; the plain path's SDPA does not), layer
# after layer. Measured worst gap (CPU, interpreter): 1.9 % of the logits' largest magnitude,
# bounded at 3 %. In fp32 only the summation order differs: measured 4.3e-6, bounded at 2e-5.
BF16_GAP_OF_SCALE = 0.03
FP32_ATOL = 2e-5


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    overrides = dict(vocab_size=VOCAB, eos_token_id=VOCAB - 1, hidden_size=HIDDEN)
    return write_causal_lm(tmp_path_factory.mktemp("target"), seed=5, overrides=overrides)


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter_dir(request, tmp_path_factory):
    """A tiny drafter in z-lab's layout with the heads of one variant."""
    fields = VARIANTS[request.param]
    is_causal = fields.get("is_causal")
    config = dflash_config_dict(
        layer_types=LAYER_TYPES, sliding_window=6, hidden_size=HIDDEN, is_causal=is_causal
    )
    config |= {k: v for k, v in fields.items() if k != "is_causal"}
    return write_drafter(tmp_path_factory.mktemp(request.param), config, seed=13)


def new_engine(drafter_dir, target_dir, dtype, kernels, graph_batch_sizes=()):
    model = load_drafter(drafter_dir, target_dir, dtype=dtype, device=DEVICE)
    if kernels:
        model.use_gpu_kernels()
    return DrafterEngine(model, max_slots=4, max_len=MAX_LEN, graph_batch_sizes=graph_batch_sizes)


def features(engine, num_tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, engine.feature_dim, generator=generator)


def fill(engine, contexts, seed=0):
    """Open one slot per context length; slots are taken in reverse so they are not 0..B-1."""
    slots = [engine.open_sequence() for _ in range(4)][::-1][: len(contexts)]
    for slot, length in zip(slots, contexts, strict=True):
        engine.add_context(slot, features(engine, length, seed=seed + length))
    return slots


def eager_and_counted_graphed(drafter_dir, target_dir, monkeypatch):
    """An eager bf16 engine and one with a batch-3 draft graph whose replays are counted,
    each with slots holding 5, 3 and 9 context rows."""
    dtype = torch.bfloat16
    eager = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    graphed = new_engine(drafter_dir, target_dir, dtype, kernels=True, graph_batch_sizes=(3,))
    replays = []
    replay = graphed.graphs.replay
    monkeypatch.setattr(graphed.graphs, "replay", lambda *a: replays.append(1) or replay(*a))
    slots = {engine: fill(engine, (5, 3, 9)) for engine in (eager, graphed)}
    return eager, graphed, slots, replays


def assert_fused_step_drafts_as_eager(eager, graphed, slots, new) -> None:
    """add_context_and_draft of each engine's `new` rows on the graphed engine drafts what
    add_context, then draft, gives on the eager one."""
    for slot, rows in zip(slots[eager], new[eager], strict=True):
        eager.add_context(slot, rows)
    expected = eager.draft(slots[eager], list(ANCHORS), 15)
    assert graphed.add_context_and_draft(slots[graphed], new[graphed], list(ANCHORS), 15) == (
        expected
    )


def draft_logits(engine, slots, num_drafts):
    mask = engine.config.mask_token_id
    block = [[a] + [mask] * num_drafts for a in ANCHORS[: len(slots)]]
    with torch.inference_mode():
        ids = torch.tensor(block, device=engine.device)
        return engine.model.draft_logits(engine.cache, slots, ids)


def assert_paths_agree(kernel, plain, dtype):
    """The kernel path's logits against the plain path's; returns the measured gap."""
    gap = (kernel - plain).abs().max().item()
    if dtype == torch.float32:
        assert gap <= FP32_ATOL, gap
    else:
        scale = plain.abs().max().item()
        assert gap <= BF16_GAP_OF_SCALE * scale, (gap, scale)
    return gap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_kernel_path_matches_plain_path(drafter_dir, target_dir, dtype, num_seqs):
    engines = {
        kernels: new_engine(drafter_dir, target_dir, dtype, kernels) for kernels in (True, False)
    }
    contexts = CONTEXTS[:num_seqs] if num_seqs > 1 else CONTEXTS[2:]
    slots = {kernels: fill(engine, contexts) for kernels, engine in engines.items()}
    for num_drafts in (15, 4):
        kernel = draft_logits(engines[True], slots[True], num_drafts)
        plain = draft_logits(engines[False], slots[False], num_drafts)
        assert kernel.shape == (num_seqs, num_drafts, VOCAB)
        assert_paths_agree(kernel, plain, dtype)


def test_scratch_block_keys_never_leak(drafter_dir, target_dir):
    """Draft 15, add context, draft 4: equals the plain path, and bit-equals a kernel-path
    engine that never drafted before (the first draft's scratch lies past the second block)."""
    dtype = torch.bfloat16
    kernel = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    plain = new_engine(drafter_dir, target_dir, dtype, kernels=False)
    fresh = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    slots = {engine: fill(engine, CONTEXTS) for engine in (kernel, plain, fresh)}
    draft_logits(kernel, slots[kernel], 15)
    draft_logits(plain, slots[plain], 15)
    for engine in (kernel, plain, fresh):
        for slot, length in zip(slots[engine], (3, 1, 2), strict=True):
            engine.add_context(slot, features(engine, length, seed=100 + length))
    after = {engine: draft_logits(engine, slots[engine], 4) for engine in (kernel, plain, fresh)}
    assert torch.equal(after[kernel], after[fresh])
    assert_paths_agree(after[kernel], after[plain], dtype)
    drafts = kernel.draft(slots[kernel], list(ANCHORS), 4)  # the first 4 of a full block
    assert drafts == draft_logits(kernel, slots[kernel], 15)[:, :4].argmax(-1).tolist()


def test_graphs_need_the_kernel_path(drafter_dir, target_dir):
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        new_engine(drafter_dir, target_dir, torch.float32, kernels=False, graph_batch_sizes=(1,))


@needs_gpu
@pytest.mark.gpu
def test_graph_replay_equals_eager_kernel_path(drafter_dir, target_dir):
    dtype = torch.bfloat16
    eager = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    graphed = new_engine(drafter_dir, target_dir, dtype, kernels=True, graph_batch_sizes=(1, 3))
    assert graphed.graphs.graphs.has(3) and graphed.graphs.graphs.has(1)
    slots = {engine: fill(engine, CONTEXTS) for engine in (eager, graphed)}
    for round_index in range(3):
        for count in (1, 3):
            drafts = [
                engine.draft(slots[engine][:count], list(ANCHORS[:count]), 15)
                for engine in (eager, graphed)
            ]
            assert drafts[0] == drafts[1], (round_index, count)
        for engine in (eager, graphed):
            for slot in slots[engine]:
                engine.add_context(slot, features(engine, 2 + round_index, seed=round_index))
    # Fewer drafts: the graph drafts a full block and keeps its first 4 (a 4-draft block
    # differs: the block's mask positions attend to each other).
    full = eager.draft(slots[eager], list(ANCHORS), 15)
    assert graphed.draft(slots[graphed], list(ANCHORS), 4) == [ids[:4] for ids in full]
    # A batch size that was not captured (2) runs the same kernels eagerly, on a full block.
    pair = list(ANCHORS[:2])
    assert eager.draft(slots[eager][:2], pair, 4) == graphed.draft(slots[graphed][:2], pair, 4)


@needs_gpu
@pytest.mark.gpu
def test_fused_context_and_draft_graph_equals_separate_steps(drafter_dir, target_dir):
    """The captured add-context-then-draft step (context padded to 16 rows) drafts what
    add_context followed by draft gives eagerly, round after round."""
    dtype = torch.bfloat16
    eager = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    graphed = new_engine(drafter_dir, target_dir, dtype, kernels=True, graph_batch_sizes=(1, 3))
    slots = {engine: fill(engine, (5, 3, 9)) for engine in (eager, graphed)}
    for round_index, new_rows in enumerate((1, 16, 7)):
        new = {
            engine: [features(engine, new_rows, seed=10 * round_index + i) for i in range(3)]
            for engine in (eager, graphed)
        }
        for slot, rows in zip(slots[eager], new[eager], strict=True):
            eager.add_context(slot, rows)
        expected = eager.draft(slots[eager], list(ANCHORS), 15)
        fused = graphed.add_context_and_draft(slots[graphed], new[graphed], list(ANCHORS), 15)
        assert fused == expected, round_index
        assert [graphed.context_length(s) for s in slots[graphed]] == [
            eager.context_length(s) for s in slots[eager]
        ]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("new_rows", [(2, 40, 16), (30, 40, 21)])
@pytest.mark.parametrize("context_graphs", [True, False])
def test_prompt_sized_context_still_replays_the_graph(
    drafter_dir, target_dir, monkeypatch, new_rows, context_graphs
):
    """A request's first draft brings its whole prompt's features: the rows beyond the graph's
    16 are added first (those of every slot in one forward: a context graph's replay, or
    without one an eager forward), and the batch still replays its graph (every request in
    it would otherwise wait for an eager forward), drafting what the eager steps give. (The
    drafter's projections run on cuBLAS, whose bits for a row are assumed here not to depend
    on how many rows share the call; the fused test above assumes it too. Drafts need not be
    exact: were that to change on another GPU, only this equality would.)"""
    eager, graphed, slots, replays = eager_and_counted_graphed(drafter_dir, target_dir, monkeypatch)
    forwards, context_replays = [], []
    add = graphed.model.add_context_on_device
    monkeypatch.setattr(
        graphed.model, "add_context_on_device", lambda *a: forwards.append(1) or add(*a)
    )
    if context_graphs:
        replay_context = graphed.context_graphs.graphs.replay_as_filled
        monkeypatch.setattr(
            graphed.context_graphs.graphs,
            "replay_as_filled",
            lambda *a: context_replays.append(1) or replay_context(*a),
        )
    else:
        graphed.context_graphs = None
    new = {engine: [features(engine, n, seed=n) for n in new_rows] for engine in slots}
    assert_fused_step_drafts_as_eager(eager, graphed, slots, new)
    assert replays == [1]
    # The leading rows; the graphs' own adds are captured, not called.
    assert (context_replays, forwards) == (([1], []) if context_graphs else ([], [1]))
    lengths = [old + n for old, n in zip((5, 3, 9), new_rows, strict=True)]
    assert [graphed.context_length(s) for s in slots[graphed]] == lengths


@needs_gpu
@pytest.mark.gpu
def test_context_graph_adds_packed_rows_as_the_eager_forward(drafter_dir, target_dir, monkeypatch):
    """ContextGraphs.add, padded to the smallest captured row count that holds the rows,
    writes each slot's keys and values as the eager add_contexts does (to rounding: the
    projections see more rows), advances the lengths, up to a full slot, and changes nothing
    else in the cache but the padding row (slot 0's last, past max_len); more rows than the
    largest count are refused with nothing done. Captured after the slots were filled, so
    capturing must leave their context alone too."""
    graphed = new_engine(drafter_dir, target_dir, torch.bfloat16, kernels=True)
    eager = new_engine(drafter_dir, target_dir, torch.bfloat16, kernels=True)
    slots = {engine: fill(engine, (5, 56, 9, 3)) for engine in (graphed, eager)}
    graphs = ContextGraphs(graphed.model, graphed.cache, max_rows=64, row_counts=(32, 16))
    assert ContextGraphs(graphed.model, graphed.cache, 20, (16, 64, 32)).row_counts == (16, 32)
    replayed = []
    replay = graphs.graphs.replay_as_filled
    monkeypatch.setattr(
        graphs.graphs, "replay_as_filled", lambda count: replayed.append(count) or replay(count)
    )
    cache = graphed.cache
    assert 0 in slots[graphed]  # the padding row's slot holds context too
    for name in ("keys", "values"):
        context = (getattr(engine.cache, name)[:, :, :MAX_LEN] for engine in (graphed, eager))
        assert torch.equal(*context), name
    rounds = (([0, 2, 3], (20, 5, 2)), ([3, 1, 0], (1, 8, 7)), ([2, 0], (30, 3)))
    for round_index, (order, counts) in enumerate(rounds):
        picked = {engine: [slots[engine][i] for i in order] for engine in slots}
        new = [features(graphed, n, seed=40 * round_index + n) for n in counts]
        starts = [cache.lengths[slot] for slot in picked[graphed]]
        before = (cache.keys.clone(), cache.values.clone(), list(cache.lengths))
        added = graphs.add(picked[graphed], [rows.to(DEVICE) for rows in new])
        assert added == (sum(counts) <= 32), round_index
        if not added:
            assert torch.equal(cache.keys, before[0]) and torch.equal(cache.values, before[1])
            assert cache.lengths == before[2]
            continue
        with torch.inference_mode():
            eager.model.add_contexts(eager.cache, picked[eager], new)
        untouched = torch.ones(cache.keys.shape[1:3], dtype=torch.bool, device=DEVICE)
        untouched[0, -1] = False  # the padding row
        for slot, eager_slot, start, n in zip(
            picked[graphed], picked[eager], starts, counts, strict=True
        ):
            assert cache.lengths[slot] == eager.cache.lengths[eager_slot] == start + n
            untouched[slot, start : start + n] = False
            for name in ("keys", "values"):
                torch.testing.assert_close(
                    getattr(cache, name)[:, slot, start : start + n],
                    getattr(eager.cache, name)[:, eager_slot, start : start + n],
                )
        for name, old in zip(("keys", "values"), before[:2], strict=True):
            assert torch.equal(getattr(cache, name)[:, untouched], old[:, untouched]), name
    assert replayed == [32, 16]  # 27 rows padded to 32, then exactly 16
    assert [cache.lengths[s] for s in slots[graphed]] == [25 + 7, 64, 9 + 5, 3 + 2 + 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_several_slots_contexts_in_one_forward(drafter_dir, target_dir, dtype, monkeypatch):
    """add_contexts (a draft batch's leading rows) writes each slot's keys and values as
    add_context does slot by slot (to rounding), in one forward, up to a full slot (56 + 8
    rows of MAX_LEN 64) beside a slot with far more new rows, and leaves other slots alone."""
    together = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    alone = new_engine(drafter_dir, target_dir, dtype, kernels=True)
    slots = {engine: fill(engine, (5, 56, 9, 3)) for engine in (together, alone)}
    forwards = []
    add = together.model.add_context_on_device
    monkeypatch.setattr(
        together.model, "add_context_on_device", lambda *a: forwards.append(1) or add(*a)
    )
    new = [features(together, n, seed=20 + n) for n in (30, 8, 17)]
    with torch.inference_mode():
        together.model.add_contexts(together.cache, slots[together][:3], new)
        for slot, rows in zip(slots[alone], new, strict=False):
            alone.add_context(slot, rows)
    assert forwards == [1]
    for a, b in zip(slots[together], slots[alone], strict=True):
        length = alone.cache.lengths[b]
        assert together.cache.lengths[a] == length
        # Close, not equal: a matmul's bits for a row may depend on how many rows share it
        # (fp32 on this CPU's BLAS they do); misplaced rows would be far off.
        for cached in ("keys", "values"):
            torch.testing.assert_close(
                getattr(together.cache, cached)[:, a, :length],
                getattr(alone.cache, cached)[:, b, :length],
            )
    assert [together.cache.lengths[s] for s in slots[together]] == [35, 64, 26, 3]


@needs_gpu
@pytest.mark.gpu
def test_deferred_context_joins_the_next_graph_replay(drafter_dir, target_dir, monkeypatch):
    """Paced-out steps' rows (deferred) enter with the next draft inside its graph: one
    replay, drafting what eager add_context of every row, then draft, gives."""
    eager, graphed, slots, replays = eager_and_counted_graphed(drafter_dir, target_dir, monkeypatch)
    for step in range(3):  # three paced-out steps of one committed token each
        for engine in slots:
            for i, slot in enumerate(slots[engine]):
                rows = features(engine, 1, seed=10 * step + i)
                if engine is eager:
                    eager.add_context(slot, rows)
                else:
                    graphed.defer_context(slot, rows)
    assert [graphed.cache.lengths[s] for s in slots[graphed]] == [5, 3, 9]
    new = {engine: [features(engine, n, seed=100 + n) for n in (1, 4, 2)] for engine in slots}
    assert_fused_step_drafts_as_eager(eager, graphed, slots, new)
    assert replays == [1]
    assert [graphed.cache.lengths[s] for s in slots[graphed]] == [9, 10, 14]
