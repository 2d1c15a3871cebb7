"""The Unicode helpers of llama.cpp's `unicode.cpp` that decide token boundaries.

llama.cpp does not run pre-tokenizer regexes on the text itself. It decodes UTF-8 its own
way (`unicode_cpts_from_utf8`: each byte that does not start a well-formed sequence becomes
U+FFFD; surrogates and overlong forms are accepted), classifies every code point with a
table generated from the `regex` package (`\\p{N}`, `\\p{L}`, ... and `\\s`), and matches the
regexes against a "collapsed" copy of the text in which every non-ASCII code point is
replaced by one byte that stands for its class. Reproducing those three steps is what makes
the splits equal llama.cpp's, including its quirks (for example `~` matches neither `\\p{P}`
nor `\\p{S}` because the ASCII part of those classes is a fixed list).
"""
from __future__ import annotations

import codecs

import regex

REPLACEMENT_CHARACTER = "\ufffd"

# Stand-in characters of the collapsed text (llama.cpp's k_ucat_cpt); ASCII stays as is.
COLLAPSED_NUMBER = "\xd1"
COLLAPSED_LETTER = "\xd2"
COLLAPSED_PUNCTUATION = "\xd3"
COLLAPSED_ACCENT_MARK = "\xd4"
COLLAPSED_SYMBOL = "\xd5"
COLLAPSED_OTHER = "\xd0"        # separators that are not whitespace, controls, unassigned
COLLAPSED_WHITESPACE = "\x0b"   # non-ASCII whitespace; C++ std::regex `\s` is ASCII-only

# llama.cpp's unicode_cpt_flags categories in bit order; the first that matches wins, as
# the table generator gives each code point exactly one of them.
_CATEGORY = regex.compile(r"(\p{N})|(\p{L})|(\p{Z})|(\p{M})|(\p{P})|(\p{S})|(\p{C})")
_COLLAPSED_BY_GROUP = {
    1: COLLAPSED_NUMBER,
    2: COLLAPSED_LETTER,
    3: COLLAPSED_OTHER,
    4: COLLAPSED_ACCENT_MARK,
    5: COLLAPSED_PUNCTUATION,
    6: COLLAPSED_SYMBOL,
    7: COLLAPSED_OTHER,
}
_WHITESPACE = regex.compile(r"\s")

_collapsed_cache: dict[int, str] = {}


def collapsed_char(cp: int) -> str:
    """The one-character class of a non-ASCII code point in llama.cpp's collapsed text."""
    c = _collapsed_cache.get(cp)
    if c is None:
        ch = chr(cp)
        if _WHITESPACE.match(ch):
            c = COLLAPSED_WHITESPACE
        else:
            m = _CATEGORY.match(ch)
            c = _COLLAPSED_BY_GROUP[m.lastindex] if m else COLLAPSED_OTHER
        _collapsed_cache[cp] = c
    return c


def collapse(text: str) -> str:
    """llama.cpp's collapsed text: ASCII kept, every other code point replaced by its class."""
    if text.isascii():
        return text
    table = {ord(ch): collapsed_char(ord(ch)) for ch in set(text) if ord(ch) >= 0x80}
    return text.translate(table)


def whitespace_to_vt(text: str) -> str:
    """The text llama.cpp gives std::wregex: non-ASCII whitespace replaced by U+000B."""
    if text.isascii():
        return text
    table = {ord(ch): COLLAPSED_WHITESPACE for ch in set(text)
             if ord(ch) >= 0x80 and collapsed_char(ord(ch)) == COLLAPSED_WHITESPACE}
    return text.translate(table) if table else text


def utf8_len(lead: int) -> int:
    """unicode_len_utf8: sequence length announced by a lead byte (1 for stray bytes)."""
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


def _decode_one(data: bytes, i: int) -> tuple[str, int]:
    """unicode_cpt_from_utf8 at data[i]: (character, bytes used), U+FFFD over one byte if bad."""
    b0 = data[i]
    if b0 < 0x80:
        return chr(b0), 1
    size = 2 if b0 & 0xE0 == 0xC0 else 3 if b0 & 0xF0 == 0xE0 else 4 if b0 & 0xF8 == 0xF0 else 0
    if size == 0 or i + size > len(data) or any(data[j] & 0xC0 != 0x80 for j in range(i + 1, i + size)):
        return REPLACEMENT_CHARACTER, 1
    cp = b0 & (0x7F >> size)
    for j in range(i + 1, i + size):
        cp = (cp << 6) | (data[j] & 0x3F)
    return (chr(cp) if cp <= 0x10FFFF else REPLACEMENT_CHARACTER), size


def _decode_error(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: continue where Python's strict decoder stops, as llama.cpp would."""
    assert isinstance(err, UnicodeDecodeError)   # registered for decoding only
    ch, size = _decode_one(err.object, err.start)
    return ch, err.start + size


codecs.register_error("llm.llama_cpp_utf8", _decode_error)


def decode_utf8(data: bytes) -> str:
    """unicode_cpts_from_utf8 as a str: llama.cpp's lenient decoding of arbitrary bytes.

    Well-formed UTF-8 decodes as usual (and at C speed: only the faults go through
    `_decode_one`). A lead byte whose sequence is cut short or has a bad continuation byte,
    and every stray byte, becomes U+FFFD and decoding resumes at the next byte; surrogates
    and overlong forms decode to their value as llama.cpp does. A value above U+10FFFF
    (from lead bytes F4..F7), which llama.cpp cannot encode again, also becomes U+FFFD.
    """
    return data.decode("utf-8", "llm.llama_cpp_utf8")


def encode_utf8(text: str) -> bytes:
    """unicode_cpt_to_utf8 over a str; lone surrogates are encoded as llama.cpp does."""
    return text.encode("utf-8", "surrogatepass")


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    for b in printable:
        chars[b] = chr(b)
    n = 0
    for b in range(256):
        if not chars[b]:
            chars[b] = chr(256 + n)
            n += 1
    return chars


BYTE_TO_CHAR: list[str] = _gpt2_byte_chars()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# bytes.decode("latin-1") gives one char per byte; this table then maps it to GPT-2's char.
_BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(data: bytes) -> str:
    """Bytes as GPT-2 byte-level characters, one character per byte."""
    return data.decode("latin-1").translate(_BYTE_ENCODE_TABLE)
