"""The gateway's request runner on in-process services with a scripted drafter, so that the
block boundaries are known: stops inside a block, straddling blocks, at max_tokens."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from dflash_serve.service_info import TargetInfo
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.scripted_drafter import ScriptedDrafter
from dflash_serve.speculative.types import SamplingParams
from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.generation import Finished, Generator
from gateway.metrics import GatewayMetrics
from gateway.schemas import GenerationRequest
from gateway.stop_strings import StopStringMatcher
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget

NUM_REFERENCE = 60
PROMPT_TEXT = "The quick brown fox"


class LocalBackends:
    """What Generator needs of gateway.backends.Backends, over in-process sessions."""

    def __init__(self, target: InProcessTarget, continuation, vocab: int) -> None:
        config = target.engine.config
        self.target_info = TargetInfo(
            "local", vocab, config.eos_token_ids, 512, (), 16, config.hidden_size, "cpu", 4
        )
        self.is_drafter_usable, self.feature_transport, self.shared_buffer = True, "inline", None
        self.target = self
        self.drafter = self
        self._target, self._continuation, self._vocab = target, continuation, vocab
        self.accept_pattern = [15]

    async def open(self, *args):
        if isinstance(args[0], SamplingParams):
            return await self._target.open(args[0])
        return ScriptedDrafter(self._continuation, self.accept_pattern, self._vocab)

    def drafter_failed(self, error) -> None:
        raise AssertionError(f"the scripted drafter does not fail: {error}")


@pytest.fixture(scope="module")
def setup(byte_level_pair):
    target_dir, _ = byte_level_pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = load_target_model(target_dir)
    target = InProcessTarget(TargetEngine(model, StateShape(2, 512)))
    prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)

    async def reference():
        session = await target.open(SamplingParams())
        run = SpeculativeGeneration(session, None, prompt, StopRules(NUM_REFERENCE), 15, 512)
        tokens = [t async for t in run.tokens()]
        await session.close()
        return tokens

    tokens = asyncio.run(reference())
    backends = LocalBackends(target, tokens, model.config.vocab_size)
    config = GatewayConfig(target_address="-", tokenizer_path=str(target_dir))
    generator = Generator(config, backends, tokenizer, GatewayMetrics("test"))
    yield generator, tokenizer, prompt, tokens
    target.close()


def run_request_deltas(generator, prompt, **fields):
    request = GenerationRequest(
        is_chat=False, model=None, prompt_ids=tuple(prompt), ignore_eos=True, **fields
    )

    async def collect():
        texts, finished = [], None
        async for event in generator.generate(request, list(prompt)):
            if isinstance(event, Finished):
                finished = event
            else:
                texts.append(event.text)
        return texts, finished

    return asyncio.run(collect())


def run_request(generator, prompt, **fields):
    texts, finished = run_request_deltas(generator, prompt, **fields)
    return "".join(texts), finished


def expected_stop(tokenizer, tokens, stop: str) -> tuple[str, int]:
    """Oracle: the fewest tokens whose text contains `stop`, and the text before it."""
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if stop in text:
            return text[: text.index(stop)], k
    raise AssertionError("stop string not in the reference")


def ascii_run(tokens, start: int, length: int = 3) -> int:
    """First index >= start where `length` single-byte (ASCII) tokens follow."""
    for i in range(start, len(tokens) - length):
        if all(t < 128 for t in tokens[i : i + length]):
            return i
    raise AssertionError("no ASCII run in the reference output")


@pytest.mark.parametrize("where", ["inside one block", "across two blocks", "across three"])
def test_stop_string_ends_the_text_exactly(setup, where):
    generator, tokenizer, prompt, tokens = setup
    i = ascii_run(tokens, 1)  # the stop string is tokens i, i+1, i+2
    # Blocks after the prefill token: [1 .. k+1], [k+2 .. 2k+2], … for acceptance pattern [k].
    generator.backends.accept_pattern = {
        "inside one block": [i + 2],  # first block ends at token i+3
        "across two blocks": [i],  # first block ends at token i+1
        "across three": [0],  # one token per block
    }[where]
    stop = bytes(tokens[i : i + 3]).decode()
    text, finished = run_request(generator, prompt, stop_strings=(stop,), max_tokens=NUM_REFERENCE)
    expected_text, expected_count = expected_stop(tokenizer, tokens, stop)
    assert text == expected_text, where
    assert finished.finish_reason == "stop"
    assert finished.usage.completion_tokens == expected_count
    assert finished.usage.prompt_tokens == len(prompt)
    generator.backends.accept_pattern = [15]


def test_stop_string_coinciding_with_max_tokens_reports_stop(setup):
    generator, tokenizer, prompt, tokens = setup
    i = ascii_run(tokens, 10)
    stop = bytes(tokens[i : i + 3]).decode()
    expected_text, count = expected_stop(tokenizer, tokens, stop)
    text, finished = run_request(generator, prompt, stop_strings=(stop,), max_tokens=count)
    assert (text, finished.finish_reason, finished.usage.completion_tokens) == (
        expected_text,
        "stop",
        count,
    )
    text, finished = run_request(generator, prompt, stop_strings=(stop,), max_tokens=count - 1)
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == count - 1
    assert stop not in text


def test_stop_token_inside_a_block(setup):
    generator, tokenizer, prompt, tokens = setup
    index = next(i for i in range(5, 16) if tokens[i] not in tokens[:i])
    text, finished = run_request(
        generator, prompt, stop_token_ids=(tokens[index],), max_tokens=NUM_REFERENCE
    )
    assert finished.finish_reason == "stop"
    assert finished.usage.completion_tokens == index + 1
    assert text == tokenizer.decode(tokens[:index], skip_special_tokens=True)


def test_no_stop_returns_everything_up_to_max_tokens(setup):
    generator, tokenizer, prompt, tokens = setup
    text, finished = run_request(generator, prompt, max_tokens=37)
    assert text == tokenizer.decode(tokens[:37], skip_special_tokens=True)
    assert (finished.finish_reason, finished.usage.completion_tokens) == ("length", 37)


@pytest.mark.parametrize("stop_strings", [(), ("no such text",), ("the ", "a ")])
def test_a_steps_tokens_are_streamed_as_one_delta(setup, stop_strings):
    """Blocks of 16 tokens: the prefill's token, two whole blocks, then 4 of the third (37
    tokens) reach the client as at most one delta per step plus the held-back tail, not one
    per token, with or without stop strings to watch for."""
    generator, tokenizer, prompt, tokens = setup
    deltas, finished = run_request_deltas(
        generator, prompt, max_tokens=37, stop_strings=stop_strings
    )
    # What a step's text is, whatever the gateway pushes token by token within it: the text
    # so far less what may still turn out to be a stop string or a split character.
    detokenizer, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(stop_strings)
    steps = [tokens[0:1], tokens[1:17], tokens[17:33], tokens[33:37]]
    expected = [matcher.push(detokenizer.extend(step))[0] for step in steps]
    expected.append(matcher.push(detokenizer.flush())[0] + matcher.flush())
    assert deltas == [delta for delta in expected if delta]
    assert "".join(deltas) == tokenizer.decode(tokens[:37], skip_special_tokens=True)
    assert finished.usage.completion_tokens == 37
