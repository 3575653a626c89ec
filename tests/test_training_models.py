"""Training the embedded pair uses the serving models: check each training path against them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_serve.checkpoint.synthetic import (
    small_drafter_config,
    small_target_config,
    stored_dtype,
)
from drafter_service.model.context_cache import DrafterContextCache
from drafter_service.model.loader import load_drafter
from target_service.engine import TargetEngine
from target_service.model.chunked_delta_rule import chunked_gated_delta_rule
from target_service.model.delta_rule import gated_delta_rule
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from training.copy_drills import copy_drills
from training.drafter_blocks import block_logits, block_loss, sample_anchors
from training.export import save_drafter, save_target
from training.generate import generate_greedy, prompt_batches
from training.generation_cache import cached_answers
from training.schedule import OptimSettings
from training.target_lm import forward_rows, init_target
from training.train_drafter import init_drafter
from training.train_target import (
    BatchStream,
    TargetTraining,
    train_target,
    validation_loss,
)

VOCAB = 64
EOS = 63
MASK = 62
TARGET = small_target_config(VOCAB, [EOS])
DRAFTER = small_drafter_config(VOCAB, MASK, sliding_window=5)
# A sequence pattern the tiny target learns in 30 steps, and those 30 steps.
PATTERN = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, EOS][: 6 + i % 7] for i in range(40)]
SHORT_TRAINING = TargetTraining(
    tokens_per_step=60,
    max_row_tokens=32,
    budget_s=0,
    num_steps=30,
    optim=OptimSettings(peak_lr=3e-3, warmup_steps=5),
    seed=0,
    pad_id=0,
)


def test_chunked_rule_gradients_match_the_token_by_token_recurrence():
    gen = torch.Generator().manual_seed(0)
    shape = (2, 37, 2, 8)
    q = torch.randn(shape, generator=gen) * 8**-0.5
    k = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
    v = torch.randn(2, 37, 2, 6, generator=gen)
    g = -torch.rand(2, 37, 2, generator=gen)
    beta = torch.rand(2, 37, 2, generator=gen)
    state = torch.randn(2, 2, 8, 6, generator=gen)
    grads = []
    for rule in (gated_delta_rule, lambda *a: chunked_gated_delta_rule(*a, chunk_tokens=16)):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
        out, final = rule(*inputs)
        (out.square().sum() + final.square().sum()).backward()
        grads.append([x.grad for x in inputs])
    for chunked, reference in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(chunked, reference, atol=1e-4, rtol=1e-4)


def test_target_training_lowers_the_loss_and_exports_a_servable_checkpoint(tmp_path):
    model = init_target(TARGET, seed=0, device="cpu")
    report = train_target(model, PATTERN, SHORT_TRAINING, log=lambda _: None)
    assert report["num_steps"] == 30
    assert report["loss_every_100"][0] > 3.5  # about ln(64) at the start
    assert report["final_loss"] < 1.0

    save_target(model, TARGET, tmp_path / "target")
    served = load_target_model(tmp_path / "target", torch.float32, "cpu")
    for name, parameter in model.named_parameters():  # as the checkpoint stores them
        parameter.data = parameter.data.to(stored_dtype("model." + name)).float()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected, _ = forward_rows(model, ids)
        actual, _ = forward_rows(served, ids)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_target_training_keeps_the_weights_of_its_lowest_validation_loss():
    """Validation text the training data contradicts: its loss falls, then rises as the
    model learns the training pattern; training must leave the weights of the minimum."""
    model = init_target(TARGET, seed=0, device="cpu")
    validation = [[1, 2, 3, 40, 41, 42, 43, EOS], [1, 2, 3, 4, 50, 51, EOS]]
    settings = dataclasses.replace(SHORT_TRAINING, eval_every=5)
    report = train_target(model, PATTERN, settings, lambda _: None, validation)["validation"]
    steps, losses = zip(*report["loss_by_step"], strict=True)
    assert steps == (5, 10, 15, 20, 25, 30)
    lowest = losses.index(min(losses))
    assert lowest < len(losses) - 1, "the test needs a minimum before the end"
    assert report["kept_step"] == steps[lowest]
    assert validation_loss(model, validation, settings) == pytest.approx(min(losses), abs=1e-4)
    assert validation_loss(model, validation, settings) < losses[-1] - 0.1


def test_loss_starts_leave_only_the_answer_tokens_labelled():
    sequences = [[1, 2, 3, 4, 5, EOS], [7, 8, 9, EOS], [10, 11, 12, 13, EOS]]
    starts = [3, 1, 4]  # index of the first token predicted (1: every token)
    settings = dataclasses.replace(SHORT_TRAINING, tokens_per_step=1000)
    inputs, labels = BatchStream(sequences, settings, starts).next_batch()
    for row_inputs, row_labels in zip(inputs.tolist(), labels.tolist(), strict=True):
        index = next(i for i, s in enumerate(sequences) if s[:-1] == row_inputs[: len(s) - 1])
        sequence, start = sequences[index], starts[index]
        expected = [-100] * (start - 1) + sequence[start:]
        assert row_labels == expected + [-100] * (len(row_labels) - len(expected))


def test_copy_drills_repeat_a_random_run_and_start_their_loss_at_the_copy():
    pool = list(range(5, 60))
    sequences, starts = copy_drills(50, pool, separator_id=2, end_id=EOS, lengths=(3, 9), seed=1)
    assert (sequences, starts) == copy_drills(50, pool, 2, EOS, (3, 9), seed=1)
    assert sequences != copy_drills(50, pool, 2, EOS, (3, 9), seed=2)[0]
    sizes = set()
    for sequence, start in zip(sequences, starts, strict=True):
        run = sequence[: start - 1]
        assert sequence == [*run, 2, *run, EOS] and set(run) <= set(pool)
        sizes.add(len(run))
    assert sizes == set(range(3, 10))


def test_warmup_rows_train_the_first_steps_and_a_probe_runs_on_schedule():
    """Warm-up rows for every step train exactly as those rows as the corpus would (the
    corpus is never read), and loss starts of 1 are the whole-row loss."""
    other = [[40, 41, 42, 43, EOS]] * 10
    settings = dataclasses.replace(SHORT_TRAINING, warmup_steps=30, probe_every=10)
    calls = []

    def probe():
        calls.append(1)
        return {"calls": float(len(calls))}

    warmed = init_target(TARGET, seed=0, device="cpu")
    report = train_target(
        warmed, other, settings, lambda _: None, loss_starts=[1] * 10,
        warmup_rows=(PATTERN, [1] * len(PATTERN)), probe=probe,
    )  # fmt: skip
    plain = init_target(TARGET, seed=0, device="cpu")
    train_target(plain, PATTERN, SHORT_TRAINING, lambda _: None)
    for (name, a), b in zip(warmed.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert report["warmup_steps"] == 30
    assert report["probe_by_step"] == [
        (10, {"calls": 1.0}),
        (20, {"calls": 2.0}),
        (30, {"calls": 3.0}),
    ]


def test_warmup_steps_without_warmup_rows_are_refused():
    model = init_target(TARGET, seed=0, device="cpu")
    settings = dataclasses.replace(SHORT_TRAINING, warmup_steps=3)
    with pytest.raises(ValueError, match="warmup_rows"):
        train_target(model, PATTERN, settings, lambda _: None)


def test_generate_greedy_equals_the_engines_target_only_decoding(tmp_path):
    model = init_target(TARGET, seed=3, device="cpu").eval()
    prompts = [[5, 9, 11], [7, 1, 2], [30, 31], [4, 4, 4, 4, 4], [8, 8]]
    # Lengths 3 and 2 have two prompts each: batches of one length; 5 is pooled alone.
    assert prompt_batches(prompts, 2, 2) == [[2, 4], [0, 1], [3]]
    assert prompt_batches(prompts, 4, 3) == [[2, 4, 0, 1], [3]]  # every length pooled
    generated = generate_greedy(
        model, prompts, 12, [EOS], max_batch=4, log=lambda _: None, min_group_rows=3
    )
    assert generated == generate_greedy(
        model, prompts, 12, [EOS], max_batch=2, log=lambda _: None, min_group_rows=2
    )
    # Decoding as one-token verify blocks, committed (the GPU kernel path's way), mixed rows.
    assert generated == generate_greedy(
        model, prompts, 12, [EOS], max_batch=4, log=lambda _: None, min_group_rows=9,
        verify_decode=True,
    )  # fmt: skip
    engine = TargetEngine(model, StateShape(max_slots=1, max_len=64))
    for prompt, tokens in zip(prompts, generated, strict=True):
        slot = engine.open_sequence()
        expected = [int(engine.prefill(slot, prompt).last_logits.argmax())]
        while len(expected) < 12 and expected[-1] != EOS:
            logits = engine.verify([slot], [[expected[-1]]]).logits
            engine.commit(slot, 1)
            expected.append(int(logits[0, -1].argmax()))
        engine.close_sequence(slot)
        assert tokens == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generate_greedy_on_the_attention_kernel_equals_plain_decoding_on_gpu():
    from training.generate import use_attention_kernel

    model = init_target(TARGET, seed=3, device="cuda").eval()
    prompts = [[5, 9, 11], [7, 1, 2], [30, 31], [4, 4, 4, 4, 4], [8, 8], [3] * 17]
    plain = generate_greedy(model, prompts, 12, [EOS], log=lambda _: None, min_group_rows=9)
    use_attention_kernel(model)
    attention = [m for m in model.modules() if hasattr(m, "attention_kernel")]
    assert attention and all(m.attention_kernel is not None for m in attention)
    on_kernel = generate_greedy(
        model, prompts, 12, [EOS], log=lambda _: None, min_group_rows=9, verify_decode=True
    )
    assert on_kernel == plain


def _trained_pair(tmp_path):
    target = init_target(TARGET, seed=1, device="cpu")
    save_target(target, TARGET, tmp_path / "target")
    target = load_target_model(tmp_path / "target", torch.float32, "cpu")
    drafter = init_drafter(DRAFTER, tmp_path / "target", seed=2, device="cpu")
    return target, drafter


def test_packed_training_blocks_equal_the_serving_drafter(tmp_path):
    """Every packed block's logits equal a draft_logits call with the context before it."""
    target, drafter = _trained_pair(tmp_path)
    gen = torch.Generator().manual_seed(5)
    token_ids = torch.randint(0, 60, (2, 40), generator=gen)
    anchors = torch.tensor([[3, 17, 30], [9, 9, 24]])  # a repeated anchor too
    taps_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        _, taps = forward_rows(target, token_ids, taps_ids)
        packed = block_logits(drafter, taps, token_ids, anchors)
        for b in range(2):
            for a, anchor in enumerate(anchors[b].tolist()):
                cache = DrafterContextCache(drafter.config, 1, 64, torch.float32, "cpu")
                drafter.add_context(cache, 0, taps[b, :anchor])
                block = torch.full((1, 16), MASK)
                block[0, 0] = token_ids[b, anchor]
                serving = drafter.draft_logits(cache, [0], block)
                torch.testing.assert_close(packed[b, a], serving[0], atol=2e-5, rtol=2e-5)


def test_block_loss_labels_are_the_tokens_at_anchor_plus_k(tmp_path):
    token_ids = torch.arange(20).unsqueeze(0)
    anchors = torch.tensor([[2, 15]])
    lengths = torch.tensor([20])
    logits = torch.full((1, 2, 15, VOCAB), -30.0)
    for a, anchor in enumerate(anchors[0].tolist()):
        for k in range(1, 16):
            if anchor + k < 20:
                logits[0, a, k - 1, anchor + k] = 30.0  # a perfect drafter
    loss, accuracy = block_loss(logits, token_ids, anchors, lengths)
    assert loss.item() < 1e-6
    assert accuracy.tolist() == [1.0] * 15  # judged on the block whose labels all exist
    logits[0, 0, 4, 40] = 60.0  # slot 5 of the first block now wrong: later slots do not count
    _, accuracy = block_loss(logits, token_ids, anchors, lengths)
    assert accuracy.tolist() == [1.0] * 4 + [0.0] * 11


def test_anchors_leave_room_for_a_label():
    gen = torch.Generator().manual_seed(0)
    first = torch.tensor([5, 0])
    lengths = torch.tensor([9, 3])
    anchors = sample_anchors(first, lengths, 500, gen)
    assert anchors[0].min() >= 5 and anchors[0].max() <= 7
    assert anchors[1].min() >= 0 and anchors[1].max() <= 1


def test_exported_drafter_loads_with_identical_weights(tmp_path):
    _, drafter = _trained_pair(tmp_path)
    save_drafter(drafter, DRAFTER, tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter", tmp_path / "target", torch.float32, "cpu")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name


def test_a_saved_drafter_continues_training_from_its_weights(tmp_path):
    """`--init-drafter`: training resumes from the saved weights (bf16 on disk), trainable."""
    _, drafter = _trained_pair(tmp_path)
    save_drafter(drafter, DRAFTER, tmp_path / "drafter")
    resumed = init_drafter(DRAFTER, tmp_path / "target", 0, "cpu", from_dir=tmp_path / "drafter")
    fresh = init_drafter(DRAFTER, tmp_path / "target", 0, "cpu")
    assert resumed.training
    trainable = {name for name, p in resumed.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in drafter.named_parameters()}
    for name, tensor in drafter.state_dict().items():
        saved = tensor.to(torch.bfloat16).float()
        assert torch.equal(resumed.state_dict()[name], saved), name
    assert not all(
        torch.equal(fresh.state_dict()[name], resumed.state_dict()[name])
        for name in fresh.state_dict()
    )


def test_embedded_drafter_depth_is_configurable():
    from training.embedded_configs import embedded_drafter_config

    config = embedded_drafter_config(4096, 5, num_layers=5)
    assert config["num_hidden_layers"] == 5 and config["layer_types"] == ["full_attention"] * 5
    assert embedded_drafter_config(4096, 5)["num_hidden_layers"] == 3


def test_cached_answers_are_reused_only_for_the_same_target_and_prompts(tmp_path):
    target = init_target(TARGET, seed=3, device="cpu").eval()
    save_target(target, TARGET, tmp_path / "target")
    prompts = [[5, 9, 11], [30, 31]]
    calls = []

    def generate():
        calls.append(1)
        return generate_greedy(target, prompts, 6, [EOS], log=lambda _: None)

    def cached(path, target_dir=tmp_path / "target", prompts=prompts, max_new=6,
               numerics="float32 on cpu", **options):  # fmt: skip
        return cached_answers(path, target_dir, prompts, max_new, [EOS], numerics, generate,
                              log=lambda _: None, **options)  # fmt: skip

    cache = tmp_path / "cache" / "generations.json"
    first, reused = cached(cache)
    assert (
        not reused and len(calls) == 1 and not cache.with_name("generations.json.partial").exists()
    )
    again, reused = cached(cache)
    assert reused and len(calls) == 1 and again == first
    assert first == generate_greedy(target, prompts, 6, [EOS], log=lambda _: None)
    with pytest.raises(ValueError, match="prompts"):
        cached(cache, prompts=prompts[:1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        cached(cache, max_new=7)
    with pytest.raises(ValueError, match="numerics"):
        cached(cache, numerics="bfloat16 on cuda")
    other = init_target(TARGET, seed=4, device="cpu")
    save_target(other, TARGET, tmp_path / "other")
    with pytest.raises(ValueError, match="target_sha256"):
        cached(cache, target_dir=tmp_path / "other")
    assert len(calls) == 1
    # A default path left by an earlier run is replaced, not refused; so is a torn file.
    _, reused = cached(cache, prompts=prompts[:1], refuse_other=False)
    assert not reused and len(calls) == 2
    cache.write_text('{"prompts": [[5')
    _, reused = cached(cache, prompts=prompts[:1], refuse_other=False)
    assert not reused and len(calls) == 3
    assert cached(cache, prompts=prompts[:1])[1]
