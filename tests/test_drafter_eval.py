"""The served-equivalent acceptance walk, and the drafter's data options of the embedded pair."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from training.drafter_eval import walk_accepted
from training.train_drafter import GeneratedSequence, behind_other_prompts, pick_sequences

EOS = 99


def simulate_served(answer, drafts_at, max_new_tokens, num_drafts):
    """Greedy speculative decoding written out token by token, as the gateway's loop runs
    it: emit the prefill's token, then per step draft, accept while each draft equals the
    target's token, emit the accepted drafts and the target's next token; stop at EOS or
    max_new_tokens. Returns the accepted count of each step that drafted."""
    emitted, steps = [answer[0]], []
    while emitted[-1] != EOS and len(emitted) < max_new_tokens:
        budget = min(num_drafts, max_new_tokens - len(emitted) - 1)
        if budget <= 0 or len(emitted) >= len(answer):
            break
        drafts = drafts_at(len(emitted) - 1)[:budget]
        kept = 0
        while (
            kept < len(drafts)
            and len(emitted) + kept < len(answer)
            and drafts[kept] == answer[len(emitted) + kept]
        ):
            kept += 1
        steps.append(kept)
        emitted += answer[len(emitted) : len(emitted) + kept + 1]
    return steps


@pytest.mark.parametrize("seed", range(40))
def test_walk_accepts_what_speculative_decoding_accepts(seed):
    rng = random.Random(seed)
    length = rng.randint(2, 60)
    answer = [rng.randrange(50) for _ in range(length - 1)]
    answer.append(EOS if rng.random() < 0.5 else rng.randrange(50))
    num_drafts, max_new = rng.choice([3, 15]), rng.randint(1, 70)
    quality = rng.random()

    def drafts_at(index):  # right tokens with some errors, a wrong one past the answer
        following = answer[index + 1 : index + 1 + num_drafts]
        drafts = [t if rng_drafts[index].random() < quality else 50 + t % 40 for t in following]
        return drafts + [98] * (num_drafts - len(drafts))

    rng_drafts = [random.Random(seed * 1000 + i) for i in range(length)]
    table = [drafts_at(i) for i in range(length)]
    correct_prefix = []
    for index in range(length):
        following = answer[index + 1 : index + 1 + num_drafts]
        run = 0
        while run < len(following) and table[index][run] == following[run]:
            run += 1
        correct_prefix.append(run)
    expected = simulate_served(answer, lambda i: table[i], max_new, num_drafts)
    assert walk_accepted(correct_prefix, answer, max_new, num_drafts, [EOS]) == expected


def test_walk_estimates_the_served_acceptance_of_the_shipped_pair(embedded_pair):
    """On 4 training prompts of the shipped pair: the walk over the target's generations and
    the engines' speculative decoding (drafting every step) agree to within one step (the
    packed training forward and the serving drafter differ in the last float bits)."""
    from bench.embedded import PairInProcess, pooled_acceptance
    from dflash_serve.speculative.types import SamplingParams
    from drafter_service.model.loader import load_drafter
    from target_service.model.loader import load_target_model
    from training.drafter_eval import walk_tau
    from training.generate import generate_greedy

    target_dir, drafter_dir = embedded_pair
    tokenizer = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    prompts = json.loads(Path("bench/embedded_training_prompts.json").read_text())[:4]
    prompt_ids = [tokenizer.encode(p).ids for p in prompts]
    eos = json.loads((Path(target_dir) / "config.json").read_text())["eos_token_id"]
    target = load_target_model(target_dir, torch.float32, "cpu").eval()
    drafter = load_drafter(drafter_dir, target_dir, torch.float32, "cpu").eval()
    answers = generate_greedy(target, prompt_ids, 128, eos, log=lambda _: None)
    walk = walk_tau(drafter, target, list(zip(prompt_ids, answers, strict=True)), 128, eos)

    served = PairInProcess(target_dir, drafter_dir, "cpu", 4096, is_adaptive=False)
    try:
        decodes = [
            asyncio.run(served.decode(ids, 128, SamplingParams(), is_speculative=True))
            for ids in prompt_ids
        ]
    finally:
        served.close()
    assert [d.token_ids for d in decodes] == answers
    served_tau, served_per_position = pooled_acceptance([d.stats for d in decodes], 15)
    served_steps = sum(d.stats.num_drafts for d in decodes)
    assert walk.tau > 2  # the pair accepts drafts here: the comparison means something
    assert abs(walk.num_steps - served_steps) <= 1, (walk, served_steps)
    assert abs(walk.tau - served_tau) <= 16 / served_steps, (walk.tau, served_tau)  # one step
    for ours, theirs in zip(walk.accept_per_position, served_per_position, strict=True):
        assert abs(ours - theirs) <= 2 / served_steps


def test_answers_go_behind_other_prompts():
    sequences = [GeneratedSequence([1, 2, 10, 11, 12], 2), GeneratedSequence([3, 20, 21], 1)]
    prompts = [[7, 7, 7], [8], [9, 9]]
    swapped = behind_other_prompts(sequences, prompts, random.Random(0))
    answers = {(10, 11, 12), (20, 21)}
    for prompt, sequence in zip(prompts, swapped, strict=True):
        assert sequence.first_anchor == len(prompt)
        assert sequence.token_ids[: len(prompt)] == prompt
        assert tuple(sequence.token_ids[len(prompt) :]) in answers
    assert len({tuple(s.token_ids[s.first_anchor :]) for s in swapped}) == 2  # both used


def test_picks_in_proportion_to_answer_length_only_when_asked():
    generator = torch.Generator().manual_seed(0)
    by_length = pick_sequences([1, 99], 20_000, True, generator)
    uniform = pick_sequences([1, 99], 20_000, False, generator)
    assert abs(by_length.float().mean().item() - 0.99) < 0.005
    assert abs(uniform.float().mean().item() - 0.5) < 0.02
