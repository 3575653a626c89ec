"""The loop's stop and fallback rules, against a scripted target written here.

The fake target "generates" a fixed sequence: its token at every position is known, so the
loop's bookkeeping (what is emitted, what is committed, when it stops) can be checked exactly.
"""

from __future__ import annotations

import asyncio

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.scripted_drafter import ScriptedDrafter
from dflash_serve.speculative.types import TargetStep

TRUTH = [10 + i for i in range(100)]  # the target's output after the prompt
PROMPT = [1, 2, 3]


class FakeTarget:
    """A target whose token at output index i is TRUTH[i], with exact acceptance."""

    def __init__(self):
        self.committed = 0  # output tokens committed (the anchor is not yet committed)
        self.blocks = []

    async def prefill(self, prompt_ids):
        return TargetStep([TRUTH[0]], 0, features=len(prompt_ids))

    async def verify(self, block_ids):
        self.blocks.append(list(block_ids))
        anchor_index = self.committed
        assert block_ids[0] == TRUTH[anchor_index], "the loop sent a wrong anchor"
        accepted = 0
        for i, draft in enumerate(block_ids[1:]):
            if draft != TRUTH[anchor_index + 1 + i]:
                break
            accepted += 1
        self.committed += accepted + 1
        produced = TRUTH[anchor_index + 1 : anchor_index + accepted + 2]
        return TargetStep(produced, accepted, features=accepted + 1)

    async def close(self):
        return None


class FailingDrafter:
    def __init__(self, fail_after):
        self.calls = 0
        self.fail_after = fail_after

    async def draft(self, features, anchor_id, num_drafts):
        self.calls += 1
        if self.calls > self.fail_after:
            raise ConnectionError("drafter went away")
        return TRUTH[:num_drafts]  # wrong drafts: nothing accepted

    async def close(self):
        return None


def run(drafter, stops, num_drafts=15, max_context=1000):
    target = FakeTarget()
    generation = SpeculativeGeneration(target, drafter, PROMPT, stops, num_drafts, max_context)

    async def collect():
        return [t async for t in generation.tokens()]

    return asyncio.run(collect()), generation, target


def test_stop_token_inside_an_accepted_block_ends_it_there():
    stop = TRUTH[7]
    tokens, gen, _ = run(ScriptedDrafter(TRUTH, [15], 1000), StopRules(50, frozenset({stop})))
    assert tokens == TRUTH[:8]
    assert gen.finish_reason == "stop"


def test_max_new_tokens_is_never_overshot_and_blocks_shrink():
    tokens, gen, target = run(ScriptedDrafter(TRUTH, [15], 1000), StopRules(20))
    assert tokens == TRUTH[:20]
    assert gen.finish_reason == "length"
    # 1 from prefill, 16 from the first block; the second block only needs 2 drafts + bonus.
    assert [len(b) for b in target.blocks] == [16, 3]


def test_stop_coinciding_with_max_tokens_reports_stop():
    tokens, gen, _ = run(ScriptedDrafter(TRUTH, [15], 1000), StopRules(9, frozenset({TRUTH[8]})))
    assert tokens == TRUTH[:9]
    assert gen.finish_reason == "stop"


def test_failing_drafter_degrades_to_target_only_with_the_same_output():
    drafter = FailingDrafter(fail_after=2)
    tokens, gen, target = run(drafter, StopRules(12))
    assert tokens == TRUTH[:12]
    assert gen.drafter_error is not None and gen.drafter is None
    # Budgets shrink towards max_tokens: 1 + 10 drafts, then 1 + 9 drafts.
    assert [len(b) for b in target.blocks[:2]] == [11, 10]
    assert all(len(b) == 1 for b in target.blocks[2:])


def test_context_limit_ends_with_length():
    # prompt 3 + committed tokens may not exceed 10 positions
    tokens, gen, target = run(ScriptedDrafter(TRUTH, [15], 1000), StopRules(50), max_context=10)
    assert gen.finish_reason == "length"
    assert tokens == TRUTH[: len(tokens)]
    assert len(PROMPT) + target.committed <= 10


def test_stats_count_drafts_and_accepted_per_position():
    _, gen, _ = run(ScriptedDrafter(TRUTH, [3, 0, 15], 1000), StopRules(40))
    stats = gen.stats
    assert stats.num_drafts >= 3
    assert stats.accepted_per_position[:4] == [
        sum(1 for a in _accepted_history(gen) if a > p) for p in range(4)
    ]
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts


def _accepted_history(gen):
    pattern = [3, 0, 15]
    return [pattern[i % 3] for i in range(gen.stats.num_drafts)]


def test_zero_max_tokens_emits_nothing():
    tokens, gen, target = run(None, StopRules(0))
    assert tokens == [] and gen.finish_reason == "length" and target.blocks == []


def test_steps_hand_on_each_steps_tokens_together():
    generation = SpeculativeGeneration(
        FakeTarget(), ScriptedDrafter(TRUTH, [15, 2], 1000), PROMPT, StopRules(40), 15, 1000
    )

    async def collect():
        return [step async for step in generation.steps()]

    # The prefill's token; 15 drafts accepted and the bonus; 2 and the bonus; 15 and the
    # bonus; 2 and the bonus (39 tokens); then no room for drafts: the 40th alone.
    expected = [TRUTH[:1], TRUTH[1:17], TRUTH[17:20], TRUTH[20:36], TRUTH[36:39], TRUTH[39:40]]
    assert asyncio.run(collect()) == expected
