"""training.embedded_pair end to end on the CPU, in miniature: against the shipped target."""

from __future__ import annotations

import json

from launcher.embedded_default import EMBEDDED_DIR
from training.corpus import Conversation, Corpus, prompt_text, save_corpus
from training.embedded_pair import held_out_prompt_sets, main, target_conversations


def tiny_corpus(tmp_path):
    """Two training conversations and one held out, saved as a corpus file."""
    conversations = [
        Conversation(name, f"What does `{name}` do?", f"{name} returns its argument.")
        for name in ("textwrap.dedent", "os.path.join", "json.dumps")
    ]
    corpus = tmp_path / "corpus.json"
    save_corpus(Corpus(tuple(conversations[:2]), tuple(conversations[2:]), "test"), corpus)
    return corpus


def test_a_drafter_run_records_its_schedule_and_reuses_its_answers(tmp_path):
    corpus = tiny_corpus(tmp_path)
    argv = [
        "--corpus", str(corpus), "--reuse-target", str(EMBEDDED_DIR / "target"),
        "--device", "cpu", "--num-generations", "2", "--max-new-tokens", "4",
        "--drafter-steps", "1", "--drafter-batch", "2", "--num-validation", "0",
        "--num-answer-checks", "2",
        "--drafter-peak-lr", "3e-4", "--drafter-warmup-steps", "0", "--commit", "test",
    ]  # fmt: skip
    first = main(["--out-dir", str(tmp_path / "first"), *argv])
    assert first["drafter_optim"]["peak_lr"] == 3e-4
    assert first["drafter_optim"]["warmup_steps"] == 0
    assert first["drafter_training"]["num_steps"] == 1
    assert not first["generation"]["reused"]
    saved = tmp_path / "first" / "generations.json"
    again = main(["--out-dir", str(tmp_path / "again"), "--generations", str(saved), *argv])
    assert again["generation"]["reused"]
    assert again["generation"]["num_tokens"] == first["generation"]["num_tokens"]
    logged = json.loads((tmp_path / "again" / "training_log.json").read_text())
    assert logged["generation"] == again["generation"]
    assert (tmp_path / "again" / "drafter" / "model.safetensors").is_file()


def test_generate_only_writes_the_answers_a_later_run_reuses(tmp_path):
    corpus = tiny_corpus(tmp_path)
    argv = [
        "--corpus", str(corpus), "--reuse-target", str(EMBEDDED_DIR / "target"),
        "--device", "cpu", "--num-generations", "2", "--max-new-tokens", "4",
        "--num-validation", "0", "--commit", "test",
    ]  # fmt: skip
    answers = tmp_path / "answers.json"
    first = main(["--out-dir", str(tmp_path / "gen"), "--generations", str(answers),
                  "--generate-only", *argv])  # fmt: skip
    assert not first["generation"]["reused"] and "drafter_training" not in first
    assert answers.is_file() and not (tmp_path / "gen" / "drafter").exists()
    logged = json.loads((tmp_path / "gen" / "training_log.json").read_text())
    assert logged["generation"] == first["generation"]
    train = ["--drafter-steps", "1", "--drafter-batch", "2", *argv]
    later = main(["--out-dir", str(tmp_path / "train"), "--generations", str(answers), *train])
    assert later["generation"]["reused"]
    assert later["generation"]["num_tokens"] == first["generation"]["num_tokens"]
    assert (tmp_path / "train" / "drafter" / "model.safetensors").is_file()


def test_a_target_run_with_answer_loss_copy_warmup_and_probes_records_them(tmp_path):
    corpus = tiny_corpus(tmp_path)
    argv = [
        "--corpus", str(corpus), "--out-dir", str(tmp_path / "pair"), "--device", "cpu",
        "--vocab-size", "300", "--target-steps", "4", "--tokens-per-step", "2048",
        "--target-loss", "answer", "--copy-warmup-steps", "2", "--target-probe-every", "2",
        "--num-answer-checks", "0", "--num-generations", "1", "--max-new-tokens", "2",
        "--num-validation", "0", "--generate-only", "--commit", "test",
    ]  # fmt: skip
    record = main([*argv, "--closed-book-repeats", "3"])
    training = record["target_training"]
    assert training["num_steps"] == 4 and training["warmup_steps"] == 2
    assert training["loss"] == "answer" and training["closed_book_repeats"] == 3
    once = main([*argv, "--out-dir", str(tmp_path / "once")])["corpus_tokens"]
    assert record["corpus_tokens"] == 3 * once  # two closed-book conversations, thrice
    steps = [step for step, _ in training["probe_by_step"]]
    assert steps == [2, 4]
    for _, measures in training["probe_by_step"]:
        assert set(measures) == {"held_out", "copy_drills"}  # no grounded question here
        assert all(0.0 <= value <= 1.0 for value in measures.values())
    assert (tmp_path / "pair" / "target" / "model.safetensors").is_file()


def test_closed_book_repeats_repeat_only_closed_book_conversations():
    closed = [Conversation(f"m.f{i}", f"What does `m.f{i}` do?", "It works.") for i in range(3)]
    grounded = Conversation("grounded:m.f0", "### `m.f0`\nIt works.\n\nWhat?", "It works.")
    corpus = Corpus((*closed, grounded), (), "test")
    repeated = target_conversations(corpus, 3, hold_validation=False)
    assert sorted(c.name for c in repeated) == sorted(
        [*[c.name for c in closed] * 3, grounded.name]
    )
    assert target_conversations(corpus, 1, hold_validation=False) == [*closed, grounded]


def test_held_out_prompts_are_split_into_grounded_and_closed_book_files():
    closed = [Conversation(f"m.f{i}", f"What does `m.f{i}` do?", "It works.") for i in range(4)]
    grounded = [
        Conversation(f"grounded:m.g{i}", f"### `m.g{i}`\nIt runs.\n\nWhat?", "It runs.")
        for i in range(3)
    ]
    mixed = Corpus((), (*closed, *grounded), "test")
    sets = held_out_prompt_sets(mixed, seed=0)
    assert set(sets) == {"held_out_prompts.json", "held_out_closed_book_prompts.json"}
    assert sorted(sets["held_out_prompts.json"]) == sorted(
        prompt_text(c.question) for c in grounded
    )
    assert sorted(sets["held_out_closed_book_prompts.json"]) == sorted(
        prompt_text(c.question) for c in closed
    )
    assert held_out_prompt_sets(mixed, seed=0) == sets  # the seed fixes the order
    only_closed = held_out_prompt_sets(Corpus((), tuple(closed), "test"), seed=0)
    assert list(only_closed) == ["held_out_prompts.json"]
    assert sorted(only_closed["held_out_prompts.json"]) == sorted(
        prompt_text(c.question) for c in closed
    )
