"""IncrementalDetokenizer against the oracle: one full decode of the whole sequence.

The tokenizer is a real byte-level BPE built here (Qwen's tokenizers are byte-level too): one
token per byte, a few merged tokens that end or start mid-character, and special tokens.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gateway.detokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer

SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Merges that split characters awkwardly: half of 中 (E4 B8 AD), a whole é, the first two
# bytes of most emoji, and a plain-ASCII word piece.
MERGED_BYTE_PAIRS = ((b"\xe4", b"\xb8"), (b"\xc3", b"\xa9"), (b"\xf0", b"\x9f"), (b" ", b"t"))
SAMPLE_CHARS = "aé中🙂 \nz€ß語😀"


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    byte_to_char = {byte: chr(byte) for byte in printable}
    num_shifted = 0
    for byte in range(256):
        if byte not in byte_to_char:
            byte_to_char[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return byte_to_char


BYTE_TO_CHAR = gpt2_bytes_to_unicode()


def byte_symbols(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[byte] for byte in data)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    assert set(BYTE_TO_CHAR.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    # Token id == byte value for the 256 single-byte tokens, which the tests rely on.
    vocab = {BYTE_TO_CHAR[byte]: byte for byte in range(256)}
    merges = [(byte_symbols(left), byte_symbols(right)) for left, right in MERGED_BYTE_PAIRS]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="module")
def merged_ids(tokenizer) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids([byte_symbols(a + b) for a, b in MERGED_BYTE_PAIRS])
    assert all(token_id >= 256 for token_id in ids)
    return ids


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))


def full_decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def stream(tokenizer, token_ids: list[int], skip_special_tokens: bool = True):
    """Feeds ids one at a time; returns (deltas from add, text from flush)."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in token_ids]
    tail = detokenizer.flush()
    assert detokenizer.text == "".join(deltas) + tail
    assert detokenizer.token_ids == token_ids
    return deltas, tail


def random_text(rng: random.Random, max_chars: int = 40) -> str:
    return "".join(rng.choice(SAMPLE_CHARS) for _ in range(rng.randint(0, max_chars)))


def test_tokenizer_really_splits_characters(tokenizer, merged_ids):
    ids = tokenizer.encode("中🙂é the")
    assert ids[:1] == [merged_ids[0]]  # E4 B8 merged, AD left on its own
    assert ids[1] == 0xAD
    assert full_decode(tokenizer, ids[:1]) == "\ufffd"


@pytest.mark.parametrize("text", ["é", "中", "🙂", "héllo 中文 🙂!", "🙂🙂🙂", "a中b🙂c"])
def test_multibyte_characters_split_across_byte_tokens_never_emit_replacement(tokenizer, text):
    byte_ids = list(text.encode("utf-8"))  # one token per byte: every character split
    deltas, tail = stream(tokenizer, byte_ids)
    assert all("\ufffd" not in delta for delta in deltas), deltas
    assert "".join(deltas) == text
    assert tail == ""


def test_each_character_is_emitted_as_soon_as_its_last_byte_arrives(tokenizer):
    deltas, _ = stream(tokenizer, list("a🙂b".encode()))
    assert deltas == ["a", "", "", "", "🙂", "b"]


@pytest.mark.parametrize("seed", range(20))
def test_valid_utf8_streams_equal_full_decode_with_no_replacement(tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(20):
        text = random_text(rng)
        for token_ids in (tokenizer.encode(text), list(text.encode("utf-8"))):
            deltas, tail = stream(tokenizer, token_ids)
            assert "".join(deltas) + tail == full_decode(tokenizer, token_ids) == text
            assert tail == ""
            assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(20))
def test_random_bytes_lose_nothing(tokenizer, merged_ids, special_ids, seed):
    rng = random.Random(1000 + seed)
    for _ in range(30):
        num_ids = rng.randint(0, 3 * MAX_WINDOW_TOKENS)
        # Mostly single bytes, sometimes a merged or a special token.
        choices = [*range(256), *merged_ids * 20, *special_ids * 10]
        token_ids = rng.choices(choices, k=num_ids)
        for skip_special_tokens in (True, False):
            deltas, tail = stream(tokenizer, token_ids, skip_special_tokens)
            expected = full_decode(tokenizer, token_ids, skip_special_tokens)
            assert "".join(deltas) + tail == expected, token_ids


@pytest.mark.parametrize("seed", range(5))
def test_runs_of_invalid_bytes_longer_than_the_window(tokenizer, seed):
    rng = random.Random(2000 + seed)
    lone_bytes = [0x80, 0xBF, 0xE4, 0xF0, 0xFF, 0xC3]  # continuation, lead and never-valid bytes
    token_ids = [rng.choice(lone_bytes) for _ in range(4 * MAX_WINDOW_TOKENS)]
    token_ids += list("中x".encode())
    deltas, tail = stream(tokenizer, token_ids)
    assert "".join(deltas) + tail == full_decode(tokenizer, token_ids)
    assert "".join(deltas).endswith("中x") and tail == ""


def test_held_replacement_chars_come_out_in_flush(tokenizer):
    token_ids = [ord("a"), 0xE4, 0xB8]  # "a" then an unfinished 中
    deltas, tail = stream(tokenizer, token_ids)
    assert "".join(deltas) == "a"
    assert tail == full_decode(tokenizer, [0xE4, 0xB8]) == "\ufffd"


def test_invalid_bytes_are_released_once_a_later_character_settles_them(tokenizer):
    deltas, tail = stream(tokenizer, [0xFF, 0xFF, ord("a"), ord("b")])
    assert deltas == ["", "", "\ufffd\ufffda", "b"]
    assert tail == ""


def test_special_tokens_skipped_or_kept(tokenizer, special_ids):
    token_ids = [*tokenizer.encode("hi 中"), special_ids[0], *list("🙂".encode()), special_ids[1]]
    deltas, tail = stream(tokenizer, token_ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == "hi 中🙂"
    deltas, tail = stream(tokenizer, token_ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "hi 中<|im_end|>🙂<|endoftext|>"
    assert deltas[len(token_ids) - 1] == "<|endoftext|>"


def test_special_token_between_the_bytes_of_a_character(tokenizer, special_ids):
    token_ids = [0xE4, special_ids[0], 0xB8, 0xAD]
    deltas, tail = stream(tokenizer, token_ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == full_decode(tokenizer, token_ids, True) == "中"


@pytest.mark.parametrize("num_leading_ids", range(2 * MAX_WINDOW_TOKENS))
def test_window_slides_that_land_inside_a_character(tokenizer, special_ids, num_leading_ids):
    # Sweeping the leading length moves every slide point across every byte of the emoji,
    # including windows that hold only its continuation bytes and a skipped special token.
    token_ids = [ord("a")] * num_leading_ids + list("🙂".encode()) + special_ids + [ord("x")]
    for skip_special_tokens in (True, False):
        deltas, tail = stream(tokenizer, token_ids, skip_special_tokens)
        assert "".join(deltas) + tail == full_decode(tokenizer, token_ids, skip_special_tokens)
        assert all("\ufffd" not in delta for delta in deltas)


def test_extend_matches_add_one_at_a_time(tokenizer):
    rng = random.Random(7)
    token_ids = list(random_text(rng, 200).encode("utf-8"))
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas, position = [], 0
    while position < len(token_ids):
        step = rng.randint(1, 8)  # a speculative step accepts several tokens at once
        deltas.append(detokenizer.extend(token_ids[position : position + step]))
        position += step
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == full_decode(tokenizer, token_ids)
    assert all("\ufffd" not in delta for delta in deltas)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_ids_per_call: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        self.num_ids_per_call.append(len(token_ids))
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
        )


def test_decode_window_stays_small_over_a_long_stream(tokenizer, special_ids):
    rng = random.Random(11)
    text = random_text(rng, 3000)
    token_ids = tokenizer.encode(text) + special_ids * 50 + tokenizer.encode(text)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)
    deltas = [detokenizer.add(token_id) for token_id in token_ids]
    assert "".join(deltas) + detokenizer.flush() == full_decode(tokenizer, token_ids)
    assert len(token_ids) > 20 * MAX_WINDOW_TOKENS
    # The window slides only once nothing is held back: an unfinished character (at most 3
    # of its bytes) can keep it open a few ids past the limit.
    assert max(counting.num_ids_per_call) <= MAX_WINDOW_TOKENS + 3
    assert len(counting.num_ids_per_call) <= 2 * len(token_ids)


def test_add_after_flush_is_an_error(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.add(ord("a"))
    assert detokenizer.flush() == ""
    assert detokenizer.text == "a"
    with pytest.raises(RuntimeError, match="after flush"):
        detokenizer.add(ord("b"))


def test_tokenizer_without_decode_is_rejected():
    with pytest.raises(TypeError, match="decode"):
        IncrementalDetokenizer(object())
