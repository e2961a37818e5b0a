"""A small scanner over partial JSON text, for streaming tool calls.

A model writes a call such as ``{"name": "f", "arguments": {"x": 1}}`` one token
at a time; the streaming parsers need to know, on every token, whether the name
is complete and how much of the arguments value has been written, without
waiting for the closing brace. ``members`` scans the top-level object of a
possibly unfinished text and reports each member's key and value span.
"""

from __future__ import annotations

from dataclasses import dataclass

_OPEN = {"{": "}", "[": "]"}


@dataclass
class Member:
    """One ``"key": value`` of the top-level object."""

    key: str
    start: int                 # index of the value's first character
    end: int | None            # index after the value; None while it is unfinished


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i]`` is ``"``: the index after the closing quote, or None if unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]`` (no leading whitespace), or
    None while it is unfinished. Scalars end at the first delimiter after them, so a number
    at the very end of ``text`` counts as unfinished."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _OPEN:
        depth = []
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in _OPEN:
                depth.append(_OPEN[c])
            elif depth and c == depth[-1]:
                depth.pop()
                if not depth:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def members(text: str, start: int = 0) -> tuple[list[Member], bool]:
    """The members of the object that opens at ``text[start]`` (after whitespace), as far
    as ``text`` goes, and whether the object is closed. Text that is no object yields
    ``([], False)``; the caller decides on malformed input when the call ends."""
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "{":
        return [], False
    out: list[Member] = []
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return out, False
        if text[i] == "}":
            return out, True
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return out, False
        key_end = _string_end(text, i)
        if key_end is None:
            return out, False
        key = text[i + 1:key_end - 1]
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return out, False
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return out, False
        end = value_end(text, i)
        out.append(Member(key, i, end))
        if end is None:
            return out, False
        i = end
