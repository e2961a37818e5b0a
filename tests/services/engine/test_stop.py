"""Tests for nibble.services.engine.stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nibble.services.engine.stop import StopStringMatcher
from nibble.services.errors import InvalidRequestError


def _run(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed deltas until stopped; returns (emitted pieces incl. flush, stopped)."""
    m = StopStringMatcher(stops)
    out = []
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stops_passes_through_without_holdback() -> None:
    m = StopStringMatcher(())
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.feed("</") == ("</", False)
    assert m.flush() == ""


def test_stop_in_one_delta() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("Hello STOP world") == ("Hello ", True)
    assert m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_split_across_deltas() -> None:
    m = StopStringMatcher(("</end>",))
    assert m.feed("abc<") == ("abc", False)
    assert m.feed("/e") == ("", False)
    assert m.feed("nd") == ("", False)
    assert m.feed(">tail") == ("", True)


def test_stop_char_by_char_never_leaks() -> None:
    out, stopped = _run(("</end>",), list("abc</end>xyz"))
    assert stopped and "".join(out) == "abc"
    assert all("<" not in piece for piece in out)


def test_false_start_is_released() -> None:
    m = StopStringMatcher(("</end>",))
    assert m.feed("a</e") == ("a", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</en") == ("", False)
    assert m.flush() == "</en"


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("xST") == ("x", False)
    assert m.flush() == "ST"
    assert m.flush() == ""


@pytest.mark.parametrize("split", [False, True])
def test_earliest_match_wins(split: bool) -> None:
    text = "hello world"
    deltas = list(text) if split else [text]
    out, stopped = _run(("world", "lo w"), deltas)
    assert stopped and "".join(out) == "hel"


def test_overlapping_prefixes() -> None:
    # "abcd" is still possible after "abc", but "bce" completes first
    out, stopped = _run(("abcd", "bce"), list("xabce"))
    assert stopped and "".join(out) == "xa"
    # a stop that overlaps itself
    out, stopped = _run(("aab",), list("aaab"))
    assert stopped and "".join(out) == "a"
    out, stopped = _run(("abab",), ["ab", "ab", "ab"])
    assert stopped and "".join(out) == ""
    # a shorter stop that is a prefix of a longer one
    out, stopped = _run(("ab", "abc"), ["xa", "bc"])
    assert stopped and "".join(out) == "x"


def test_first_completed_stop_wins_whatever_the_split() -> None:
    # "a" completes before "🌍a🌍" could, even though the latter starts earlier
    for deltas in (["🌍a🌍"], ["🌍a", "🌍"], list("🌍a🌍")):
        out, stopped = _run(("a", "🌍a🌍"), deltas)
        assert stopped and "".join(out) == "🌍"
    # same end position: the longer stop wins
    out, stopped = _run(("cd", "bcd"), ["abcde"])
    assert stopped and "".join(out) == "a"


def test_unicode() -> None:
    out, stopped = _run(("🌍!",), ["hi 🌍", " 🌍", "!", "after"])
    assert stopped and "".join(out) == "hi 🌍 "
    out, stopped = _run(("。\n",), ["東京", "。", "京都", "。", "\n", "x"])
    assert stopped and "".join(out) == "東京。京都"
    out, stopped = _run(("ñé",), ["añ", "x", "ñ", "é"])
    assert stopped and "".join(out) == "añx"


def test_empty_stop_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(("ok", ""))


def _reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Cut before the first stop string to complete, reading one character at a time."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abc🌍", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc🌍", min_size=1, max_size=4), max_size=3),
)
def test_matches_reference_for_any_split(pieces: list[str], stops: list[str]) -> None:
    m = StopStringMatcher(tuple(stops))
    longest = max((len(s) for s in stops), default=1)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
        # whatever is held back could still begin a stop string
        assert len("".join(pieces[: len(out)])) - len("".join(out)) <= longest - 1
    if not stopped:
        out.append(m.flush())
    assert ("".join(out), stopped) == _reference("".join(pieces), tuple(stops))
