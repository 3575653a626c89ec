"""Incremental detokenization: a growing list of token ids in, text deltas out.

Byte-level tokenizers (Qwen's included) split multi-byte UTF-8 characters across tokens, so
decoding one token at a time would emit U+FFFD halves that later turn into a real character.
We instead decode a short window of recent ids and emit only the part of the window's text that
can no longer change: everything before a trailing run of U+FFFD, which may still be an
incomplete character waiting for its last bytes.

The window is a suffix of the ids. Decoding it rather than the whole sequence keeps the cost per
token constant; starting it a few tokens back gives decoders that depend on the left context
(leading-space rules, byte sequences) the context they need. Only its length in characters
matters for what was already emitted, so it may start anywhere once nothing is held back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# The window slides once it holds this many ids and nothing is held back ...
MAX_WINDOW_TOKENS = 16
# ... and restarts this many ids before the end, enough left context for any decoder we serve.
NUM_CONTEXT_TOKENS = 4


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool = ...,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns token ids, added one step at a time, into final text deltas.

    The concatenation of every delta returned by `add`/`extend` and the text returned by `flush`
    equals `tokenizer.decode(token_ids, skip_special_tokens=..., clean_up_tokenization_spaces=
    False)` for the whole sequence. No delta ends in a character that a later token could still
    change, so a multi-byte character split across tokens never reaches the client as U+FFFD.
    Invalid bytes do become U+FFFD, released as soon as a later character shows they are final,
    or by `flush` at the end.
    """

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(
                f"tokenizer must have a decode(ids, ...) method, got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.is_flushed = False
        # The window is token_ids[window_start:]; the first num_window_chars_emitted characters
        # of its decoded text have been returned already.
        self.window_start = 0
        self.num_window_chars_emitted = 0
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text returned so far (every delta, plus the flushed tail once flushed)."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Appends one token id and returns the text that became final ("" when none did)."""
        return self.extend((token_id,))

    def extend(self, token_ids: Iterable[int]) -> str:
        """Appends several ids (one speculative step's accepted tokens) with a single decode."""
        if self.is_flushed:
            raise RuntimeError("IncrementalDetokenizer.extend called after flush(); make a new one")
        num_before = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if len(self.token_ids) == num_before:
            return ""
        window_text = self._decode_window()
        num_final_chars = len(window_text.rstrip(REPLACEMENT_CHAR))
        delta = window_text[self.num_window_chars_emitted : num_final_chars]
        self.num_window_chars_emitted = max(self.num_window_chars_emitted, num_final_chars)
        is_nothing_held = self.num_window_chars_emitted == len(window_text)
        if is_nothing_held and len(self.token_ids) - self.window_start >= MAX_WINDOW_TOKENS:
            self._slide_window()
        return self._record(delta)

    def flush(self) -> str:
        """Ends the stream and returns the held-back tail, U+FFFD characters included."""
        if self.is_flushed:
            return ""
        self.is_flushed = True
        if not self.token_ids:
            return ""
        window_text = self._decode_window()
        delta = window_text[self.num_window_chars_emitted :]
        self.num_window_chars_emitted = len(window_text)
        return self._record(delta)

    def _decode_window(self) -> str:
        return self.tokenizer.decode(
            self.token_ids[self.window_start :],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _slide_window(self) -> None:
        """Restarts the window a few ids before the end; only valid when nothing is held back.

        Every character of the new window's text has then been emitted, so its full length is
        the new emitted count, even if it starts mid-character with a few U+FFFD: those come
        from bytes before any later token and cannot change.
        """
        self.window_start = len(self.token_ids) - NUM_CONTEXT_TOKENS
        self.num_window_chars_emitted = len(self._decode_window())

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
