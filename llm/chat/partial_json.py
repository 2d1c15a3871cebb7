"""JSON that may still be arriving: where a value ends, or that the text ends inside it.

A streamed tool call is JSON cut anywhere. The chat parsers (llm.chat.parsers) read its
complete parts (the function name) and pass on the raw text of the arguments written so far,
which only grows as tokens arrive, as llama.cpp's common_chat_msg_parser does with its
"healing" of partial JSON. Nothing here recurses: the depth of a value is counted, not
followed down the stack.
"""
from __future__ import annotations

import json
import re

_WS = re.compile(r"[ \t\n\r]*")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_LITERALS = ("true", "false", "null")


class Incomplete(Exception):
    """The text ends before the value does."""


def skip_ws(s: str, i: int) -> int:
    m = _WS.match(s, i)
    assert m is not None
    return m.end()


def string_end(s: str, i: int) -> int:
    """The index after the closing quote of the string that opens at s[i]."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c < " ":
            raise ValueError(f"control character in a JSON string at {j}")
        j += 1
    raise Incomplete


def value_end(s: str, i: int) -> int:
    """The index after the JSON value that starts at s[i] (no leading whitespace): Incomplete
    when the text ends first, ValueError when it is not JSON. Containers are matched by their
    brackets and strings; json.loads checks the whole once it is complete."""
    if i >= len(s):
        raise Incomplete
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                j = string_end(s, j)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise Incomplete
    m = _SCALAR.match(s, i)
    if m is None:
        if any(lit.startswith(s[i:]) for lit in _LITERALS) or s[i:] == "-":
            raise Incomplete
        raise ValueError(f"not a JSON value at {i}: {s[i:i + 20]!r}")
    if m.end() == len(s) and m.group() not in _LITERALS:
        raise Incomplete        # a number may go on
    return m.end()


def members(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object that opens at s[i] as far as the text goes: {key: (start of the
    value, its end or None while it is cut)}, and the end of the object (None while it is cut)."""
    if i >= len(s):
        raise Incomplete
    if s[i] != "{":
        raise ValueError(f"expected a JSON object at {i}")
    out: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return out, j + 1
    while j < len(s):
        if s[j] != '"':
            raise ValueError(f"expected a key at {j}")
        try:
            k = string_end(s, j)
        except Incomplete:
            return out, None
        key = json.loads(s[j:k])
        j = skip_ws(s, k)
        if j >= len(s):
            return out, None
        if s[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(s, j + 1)
        try:
            end = value_end(s, j)
        except Incomplete:
            out[key] = (j, None)
            return out, None
        out[key] = (j, end)
        j = skip_ws(s, end)
        if j >= len(s):
            return out, None
        if s[j] == "}":
            return out, j + 1
        if s[j] != ",":
            raise ValueError(f"expected ',' or '}}' at {j}")
        j = skip_ws(s, j + 1)
    return out, None


def elements(s: str, i: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """The elements of the array that opens at s[i] as far as the text goes: [(start, end or
    None while it is cut)], and the end of the array (None while it is cut)."""
    if i >= len(s):
        raise Incomplete
    if s[i] != "[":
        raise ValueError(f"expected a JSON array at {i}")
    out: list[tuple[int, int | None]] = []
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "]":
        return out, j + 1
    while j < len(s):
        try:
            end = value_end(s, j)
        except Incomplete:
            out.append((j, None))
            return out, None
        out.append((j, end))
        j = skip_ws(s, end)
        if j >= len(s):
            return out, None
        if s[j] == "]":
            return out, j + 1
        if s[j] != ",":
            raise ValueError(f"expected ',' or ']' at {j}")
        j = skip_ws(s, j + 1)
    return out, None


def string_prefix(raw: str) -> str:
    """The text of a JSON string cut anywhere (raw starts at its opening quote): the characters
    whose escapes are complete."""
    for cut in range(len(raw), max(len(raw) - 6, 1) - 1, -1):
        try:
            return json.loads(raw[:cut] + '"')
        except json.JSONDecodeError:
            continue
    return ""
