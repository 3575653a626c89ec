"""Running whole generations in-process: target-only (the reference) and speculative."""

from __future__ import annotations

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import SamplingParams


async def generate(
    target, drafter_session, prompt, sampling: SamplingParams, max_new, num_drafts, pacing=None
):
    """Returns (tokens, finish_reason, stats); `drafter_session` None means target-only."""
    session = await target.open(sampling)
    run = SpeculativeGeneration(
        target=session,
        drafter=drafter_session,
        prompt_ids=prompt,
        stops=StopRules(max_new, frozenset(target.engine.config.eos_token_ids)),
        num_drafts=num_drafts,
        max_context_tokens=target.engine.state.shape.max_len,
        pacing=pacing,
    )
    try:
        tokens = [token async for token in run.tokens()]
    finally:
        await session.close()
        if drafter_session is not None:
            await drafter_session.close()
    return tokens, run.finish_reason, run.stats
