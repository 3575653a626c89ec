"""The served-equivalent acceptance walk, and the drafter's data options of the embedded pair."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import TargetStep
from training.drafter_eval import walk_accepted
from training.train_drafter import GeneratedSequence, behind_other_prompts, pick_sequences

EOS = 99


class StreamTarget:
    """A target whose greedy text is `stream` (going on past EOS, as a language model does
    inside a block): prefill gives stream[0]; verify accepts drafts while they match."""

    def __init__(self, stream):
        self.stream, self.position = stream, 0

    async def prefill(self, prompt_ids):
        return TargetStep([self.stream[0]], 0, None)

    async def verify(self, block):
        accepted = 0
        for draft in block[1:]:
            if draft != self.stream[self.position + accepted + 1]:
                break
            accepted += 1
        tokens = self.stream[self.position + 1 : self.position + accepted + 2]
        self.position += accepted + 1
        return TargetStep(tokens, accepted, None)

    async def close(self):
        pass


class TableDrafter:
    def __init__(self, target, table):
        self.target, self.table = target, table

    async def draft(self, features, anchor_id, num_drafts):
        return self.table[self.target.position][:num_drafts]

    async def close(self):
        pass


def served_stats(stream, table, max_new_tokens, num_drafts):
    """The gateway's own loop (SpeculativeGeneration) over the scripted target and drafter."""
    target = StreamTarget(stream)
    run = SpeculativeGeneration(
        target, TableDrafter(target, table), [0], StopRules(max_new_tokens, frozenset({EOS})),
        num_drafts, 10_000,
    )  # fmt: skip

    async def collect():
        return [token async for token in run.tokens()]

    return asyncio.run(collect()), run.stats


@pytest.mark.parametrize("seed", range(40))
def test_walk_accepts_what_the_gateway_loop_accepts(seed):
    """Random texts (with and without EOS, drafts past it matching the target's text),
    drafts with errors, budgets cut by max_new_tokens: the walk's steps are the loop's."""
    rng = random.Random(seed)
    stream = [rng.randrange(50) for _ in range(80)]
    if rng.random() < 0.6:
        stream[rng.randint(1, 50)] = EOS
    num_drafts, max_new, quality = rng.choice([3, 15]), rng.randint(1, 60), rng.random()
    table = [
        [t if rng.random() < quality else 50 + t % 40 for t in stream[i + 1 : i + 1 + num_drafts]]
        for i in range(len(stream) - num_drafts)
    ]
    emitted, stats = served_stats(stream, table, max_new, num_drafts)
    answer = stream[: stream.index(EOS) + 1] if EOS in stream else stream
    answer = answer[:max_new]
    assert emitted == answer
    correct_prefix = []  # labels end with the answer, as in the target's generations
    for index in range(len(answer)):
        following = answer[index + 1 : index + 1 + num_drafts]
        run = 0
        while run < len(following) and table[index][run] == following[run]:
            run += 1
        correct_prefix.append(run)
    walked = walk_accepted(correct_prefix, answer, max_new, num_drafts, [EOS])
    assert len(walked) == stats.num_drafts
    assert sum(walked) == stats.num_accepted_tokens
    per_position = [sum(kept > k for kept in walked) for k in range(num_drafts)]
    assert per_position[: len(stats.accepted_per_position)] == stats.accepted_per_position


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
    prompts_file = Path(__file__).parents[1] / "bench" / "embedded_training_prompts.json"
    prompts = json.loads(prompts_file.read_text())[:4]
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


def test_drafts_matching_past_a_stop_token_are_not_counted_accepted():
    """The target checks the whole block [1, 2, EOS, 7]: all three drafts match its text,
    but only 2, EOS are sent, so the loop's statistics count 2 accepted, not 3."""
    stream = [1, 2, EOS, 7, 8, 9, 10, 11]
    table = [stream[i + 1 : i + 4] for i in range(5)]
    emitted, stats = served_stats(stream, table, max_new_tokens=20, num_drafts=3)
    assert emitted == [1, 2, EOS]
    assert (stats.num_drafts, stats.num_accepted_tokens) == (1, 2)
    assert stats.accepted_per_position == [1, 1, 0]
