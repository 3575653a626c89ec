"""Stop strings over a stream of text deltas, as the OpenAI API defines `stop`.

A stop string can straddle any number of deltas, so the matcher holds back the longest tail of
the text that could still grow into one: a client never sees text that a later delta would have
to retract. The stop string itself is never emitted (OpenAI and vLLM behave the same way).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters text deltas, cutting the stream just before the first stop string to complete.

    `push` returns (text safe to emit now, is_stopped). Once a stop string is seen, `push`
    returns ("", True) forever; at the end of a stream that did not stop, `flush` returns the
    text still held back as a possible stop-string prefix.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if isinstance(stop_strings, str):
            raise TypeError(f"stop_strings must be a list of strings, got the str {stop_strings!r}")
        for index, stop in enumerate(stop_strings):
            if not isinstance(stop, str):
                raise TypeError(
                    f"stop_strings[{index}] must be a str, got {type(stop).__name__} {stop!r}"
                )
            if not stop:
                raise ValueError(f"stop_strings[{index}] must be a non-empty string, got ''")
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        self.max_stop_chars = max((len(stop) for stop in self.stop_strings), default=0)
        self.pending_text = ""
        self.is_stopped = False
        # The stop string that ended the stream, for the response's stop reason.
        self.matched_stop_string: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        """Adds a delta; returns the text now safe to emit and whether the stream has stopped."""
        if self.is_stopped:
            return "", True
        text = self.pending_text + delta
        match = self._find_earliest_stop(text)
        if match is not None:
            position, stop = match
            self.is_stopped = True
            self.matched_stop_string = stop
            self.pending_text = ""
            return text[:position], True
        num_held_chars = self._longest_stop_prefix_suffix(text)
        self.pending_text = text[len(text) - num_held_chars :]
        return text[: len(text) - num_held_chars], False

    def flush(self) -> str:
        """Returns the held-back text at the end of generation ("" if the stream stopped)."""
        held_text, self.pending_text = self.pending_text, ""
        return "" if self.is_stopped else held_text

    def _find_earliest_stop(self, text: str) -> tuple[int, str] | None:
        """(start position, stop string) of the match that ends first; ties go to the longest.

        Ranking by end rather than start makes the result independent of how the text was cut
        into deltas: it is the match a character-by-character scan would meet first, so a
        speculative step that accepts many tokens stops where one-token steps would. The
        held-back text contains no whole stop string (else the stream would have stopped), so
        every match found ends inside the new delta.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string.

        Any stop string that a later delta could complete starts inside this suffix, and the
        longest one starts earliest, so holding it back is both necessary and sufficient.
        """
        for num_chars in range(min(len(text), self.max_stop_chars - 1), 0, -1):
            suffix = text[len(text) - num_chars :]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return num_chars
        return 0
