"""StopStringMatcher against hand-worked streams and a character-by-character oracle."""

from __future__ import annotations

import random

import pytest

from gateway.stop_strings import StopStringMatcher


def run(stop_strings: list[str], deltas: list[str]) -> tuple[list[str], bool, str]:
    """Pushes every delta; returns (emitted pieces, stopped, flushed tail)."""
    matcher = StopStringMatcher(stop_strings)
    pieces, is_stopped = [], False
    for delta in deltas:
        piece, is_stopped = matcher.push(delta)
        pieces.append(piece)
    return pieces, is_stopped, matcher.flush()


def reference_output(stop_strings: list[str], text: str) -> tuple[str, bool]:
    """Independent oracle: scan one character at a time, stop at the first completed match."""
    for end in range(1, len(text) + 1):
        completed = [stop for stop in stop_strings if text[:end].endswith(stop)]
        if completed:
            return text[: end - max(map(len, completed))], True
    return text, False


def test_stop_string_inside_one_delta():
    pieces, is_stopped, tail = run(["STOP"], ["hello STOP world"])
    assert pieces == ["hello "]
    assert is_stopped and tail == ""


def test_stop_string_straddling_two_deltas():
    pieces, is_stopped, _ = run(["</s>"], ["answer</", "s>more"])
    assert pieces == ["answer", ""]
    assert is_stopped


def test_stop_string_straddling_three_deltas():
    pieces, is_stopped, _ = run(["<|end|>"], ["done <|", "en", "d|> trailing"])
    assert pieces == ["done ", "", ""]
    assert is_stopped


def test_partial_prefix_is_held_then_released_when_it_does_not_match():
    pieces, is_stopped, tail = run(["abc"], ["xa", "bd"])
    assert pieces == ["x", "abd"]
    assert not is_stopped and tail == ""


def test_held_prefix_comes_out_in_flush_at_the_end():
    pieces, is_stopped, tail = run(["abc"], ["hello ab"])
    assert pieces == ["hello "]
    assert not is_stopped
    assert tail == "ab"


def test_a_released_prefix_can_start_a_new_partial_match():
    # "aab": the first "a" cannot start "abc" any more, the second one still can.
    pieces, is_stopped, _ = run(["abc"], ["a", "a", "b", "c"])
    assert pieces == ["", "a", "", ""]
    assert is_stopped


def test_earliest_of_several_stop_strings_wins():
    pieces, is_stopped, _ = run(["world", "lo", "\n"], ["hello world\n"])
    assert pieces == ["hel"]
    assert is_stopped


def test_earliest_match_wins_regardless_of_list_order():
    matcher = StopStringMatcher(["C", "B", "A"])
    assert matcher.push("xxAyyBzzC") == ("xx", True)
    assert matcher.matched_stop_string == "A"


def test_match_that_completes_first_wins_over_an_overlapping_longer_one():
    # "bc" completes before "abcd" does, so a one-token-at-a-time stream stops there too.
    assert run(["abcd", "bc"], ["abcd"])[0] == ["a"]
    assert run(["abcd", "bc"], ["abc", "d"])[0] == ["a", ""]


def test_longest_stop_wins_when_two_end_at_the_same_place():
    matcher = StopStringMatcher(["c", "abc"])
    assert matcher.push("xxabc") == ("xx", True)
    assert matcher.matched_stop_string == "abc"


def test_stop_at_the_very_start():
    pieces, is_stopped, tail = run(["###"], ["###", "later"])
    assert pieces == ["", ""]
    assert is_stopped and tail == ""


def test_after_stopping_every_push_returns_nothing():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.push("para one\n") == ("para one", False)
    assert matcher.push("\npara two") == ("", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""
    assert matcher.matched_stop_string == "\n\n"


def test_no_stop_strings_pass_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"stop_strings\[1\]"):
        StopStringMatcher(["ok", ""])


def test_a_bare_string_is_rejected():
    with pytest.raises(TypeError, match="stop_strings"):
        StopStringMatcher("stop")


@pytest.mark.parametrize("seed", range(30))
def test_any_cut_into_deltas_gives_the_character_by_character_result(seed):
    rng = random.Random(seed)
    alphabet = "ab\n"
    stop_strings = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(3)]
    for _ in range(50):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [
            text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)
        ]
        pieces, is_stopped, tail = run(stop_strings, deltas)
        assert ("".join(pieces) + tail, is_stopped) == reference_output(stop_strings, text)


@pytest.mark.parametrize("seed", range(10))
def test_emitted_text_is_never_retracted(seed):
    rng = random.Random(100 + seed)
    stop_strings = ["abab", "ba\n"]
    deltas = ["".join(rng.choices("ab\n", k=rng.randint(0, 3))) for _ in range(60)]
    final_output, _ = reference_output(stop_strings, "".join(deltas))
    matcher = StopStringMatcher(stop_strings)
    emitted = ""
    for delta in deltas:
        piece, _ = matcher.push(delta)
        emitted += piece
        assert final_output.startswith(emitted)
    assert emitted + matcher.flush() == final_output
