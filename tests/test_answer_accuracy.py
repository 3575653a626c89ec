"""The right-answer count against the target's own greedy text, decoded here."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from launcher.embedded_default import EMBEDDED_DIR
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from training.answer_accuracy import answer_groups, count_right
from training.corpus import Conversation, Corpus, prompt_text
from training.generate import generate_greedy


def test_an_answer_counts_as_right_only_when_it_is_the_reference_text():
    target = load_target_model(EMBEDDED_DIR / "target", torch.float32, "cpu").eval()
    tokenizer = Tokenizer.from_file(str(EMBEDDED_DIR / "target" / "tokenizer.json"))
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    questions = ["What does `textwrap.dedent` do?", "What does `json.dumps` do?"]
    prompts = [tokenizer.encode(prompt_text(q)).ids for q in questions]
    said = [
        tokenizer.decode([t for t in answer if t not in eos])
        for answer in generate_greedy(target, prompts, 24, eos, log=lambda _: None)
    ]
    assert all(said)
    right = Conversation("textwrap.dedent", questions[0], f"\n{said[0]}  ")  # spaces aside
    wrong = Conversation("json.dumps", questions[1], said[1] + " And more.")
    grounded = Conversation("grounded:json.dumps", questions[1], said[1])
    corpus = Corpus(train=(right, wrong), held_out=(grounded,), source="test")
    groups = answer_groups(corpus, 8)
    assert groups == {"held_out_grounded": [grounded], "training": [right, wrong]}
    counts = count_right(target, tokenizer, groups, eos, 24, log=lambda _: None)
    assert {name: (c["right"], c["of"]) for name, c in counts.items()} == {
        "held_out_grounded": (1, 1),
        "training": (1, 2),
    }
    # Token accuracy, recomputed by the engine: each reference prefix prefilled afresh.
    engine = TargetEngine(target, StateShape(max_slots=1, max_len=256))
    correct = total = 0
    for conversation in (right, wrong):
        prompt = tokenizer.encode(prompt_text(conversation.question)).ids
        reference = tokenizer.encode(conversation.answer + "<|im_end|>").ids
        for k, expected in enumerate(reference):
            slot = engine.open_sequence()
            predicted = int(engine.prefill(slot, prompt + reference[:k]).last_logits.argmax())
            engine.close_sequence(slot)
            correct += predicted == expected
            total += 1
    assert 0 < correct < total
    assert counts["training"]["token_accuracy"] == round(correct / total, 4)


def test_training_groups_are_spread_over_the_corpus():
    train = tuple(Conversation(f"m{i}.f", f"q{i}", "a") for i in range(10))
    assert [c.name for c in answer_groups(Corpus(train, (), "t"), 3)["training"]] == [
        "m0.f", "m3.f", "m6.f",
    ]  # fmt: skip
