"""The text-following ceiling diagnostic: the lookup drafts what followed the longest suffix."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer

from launcher.embedded_default import EMBEDDED_DIR
from target_service.model.loader import load_target_model
from training.drafter_eval import walk_accepted
from training.generate import generate_greedy
from training.generation_cache import target_digest
from training.lookup_ceiling import SuffixLookup, is_recital, lookup_tau, main, recited_share

EOS = 99


def test_lookup_drafts_what_followed_the_longest_matching_suffix():
    lookup = SuffixLookup([[1, 2, 3, 4, 5, 6], [7, 2, 3, 8, 9]])
    # "2 3" first occurs in the first answer, but "7 2 3" only in the second: longest wins.
    assert lookup.correct_drafts([7, 2, 3], [8, 9, 0]) == 2
    assert lookup.correct_drafts([0, 2, 3], [4, 5, 6, 1]) == 3  # first occurrence of "2 3"
    assert lookup.correct_drafts([0, 2, 3], [8, 9]) == 0
    assert lookup.correct_drafts([42], [1]) == 0  # no suffix found
    assert lookup.correct_drafts([6], [7]) == 0  # answers do not run into each other


def test_a_recital_is_mostly_one_training_answers_start():
    training = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 9]]
    assert is_recital([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], training)  # 9 of 10
    assert not is_recital([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], training)  # 8 of 10
    assert not is_recital([2, 3, 4], training)  # inside an answer, not its start


def test_lookup_tau_walks_as_served():
    lookup = SuffixLookup([[1, 2, 3, 4, 5, 6, 7, EOS]])
    # Prefill emits 1; the lookup then drafts 2..EOS and all are right: one step, tau 8.
    tau, steps = lookup_tau(lookup, [[1, 2, 3, 4, 5, 6, 7, EOS]], 128, [EOS])
    assert (tau, steps) == (8.0, 1)
    # A wrong token (0) after 3: step 1 keeps 2 drafts (2, 3) and the target says 0; the
    # anchor 0 was never seen, step 2 keeps nothing, the target says 5; step 3 drafts 6 7 EOS.
    tau, steps = lookup_tau(lookup, [[1, 2, 3, 0, 5, 6, 7, EOS]], 128, [EOS])
    assert steps == 3 and tau == 1 + (2 + 0 + 3) / 3


def test_recited_share_counts_tokens_that_follow_their_8_gram():
    lookup = SuffixLookup([list(range(20))])
    assert recited_share(lookup, [list(range(12))]) == 1.0
    assert recited_share(lookup, [[*range(10), 50, 51]]) == 0.5  # 8 then 50: two of four


def test_main_measures_the_shipped_pair(tmp_path):
    """With the held-out answers themselves as the training answers, every token is recited
    and the lookup drafts each answer whole; with unrelated answers, nothing is."""
    target = EMBEDDED_DIR / "target"
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    model = load_target_model(target, torch.float32, "cpu").eval()
    texts = json.loads((EMBEDDED_DIR / "held_out_prompts.json").read_text())[:2]
    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    answers = generate_greedy(model, prompts, 32, eos, log=lambda _: None)
    records = []
    for training_answers in (answers, [[5, 6, 7]]):
        generations = tmp_path / "generations.json"
        key = {"target_sha256": target_digest(target), "numerics": "float32 on cpu"}
        generations.write_text(json.dumps(key | {"answers": training_answers}))
        out = tmp_path / "ceiling.json"
        argv = ["--generations", str(generations), "--num-prompts", "2", "--max-new-tokens",
                "32", "--out", str(out), "--commit", "test"]  # fmt: skip
        records.append(main(argv))
        assert json.loads(out.read_text()) == records[-1]
    recited, unrelated = records
    assert recited["recited_share_after_8_tokens"] == 1.0
    # Every draft right: the walk of perfect drafts, step for step.
    perfect = [walk_accepted([len(a) - 1 - i for i in range(len(a))], a, 32, 15, eos)
               for a in answers]  # fmt: skip
    steps = [kept for walk in perfect for kept in walk]
    assert recited["lookup_steps"] == len(steps)
    assert recited["tau_lookup"] == round(1 + sum(steps) / len(steps), 3)
    assert unrelated["recited_share_after_8_tokens"] == 0.0
    assert unrelated["tau_lookup"] == 1.0
    assert recited["tau_dflash"] == unrelated["tau_dflash"]  # the same generations
    assert recited["recited_answers"]["num_prompts"] == 2
    assert recited["recited_answers"]["tau_lookup"] == recited["tau_lookup"]
    assert unrelated["other_answers"]["num_prompts"] == 2
    assert unrelated["other_answers"]["tau_dflash"] == unrelated["tau_dflash"]
