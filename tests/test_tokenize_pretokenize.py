"""BPE pre-tokenizers and llama.cpp's Unicode handling (llm.tokenizers.pretokenize / unicode).

The GPT-2 and Llama-3 splits are checked against a Python port of llama.cpp's hand-written
matchers (unicode_regex_split_custom_gpt2 / _llama3) on random text; every supported
pre-tokenizer must split any text into pieces that join back to it."""
from __future__ import annotations

import random

import pytest
import regex

from llm.tokenizers.pretokenize import PRE_TOKENIZERS, collapse_regex, pre_tokenizer
from llm.tokenizers.unicode import BYTE_TO_CHAR, byte_encode, collapse, decode_utf8

_LETTER, _NUMBER, _SPACE = regex.compile(r"\p{L}"), regex.compile(r"\p{N}"), regex.compile(r"\s")


def _flags(text: str, i: int) -> tuple[bool, bool, bool]:
    """(letter, number, whitespace) of text[i]; all False past the end (llama.cpp's {})."""
    if i >= len(text):
        return False, False, False
    c = text[i]
    return bool(_LETTER.match(c)), bool(_NUMBER.match(c)), bool(_SPACE.match(c))


def _defined(text: str, i: int) -> bool:
    return i < len(text)        # every code point has some category flag in llama.cpp's table


def _llama_cpp_custom_split(text: str, llama3: bool) -> list[str]:
    """Port of unicode_regex_split_custom_gpt2 / _llama3 over one piece of text."""
    words, start, pos, n = [], 0, 0, len(text)

    def add(end: int) -> int:
        nonlocal start
        size = end - start
        if size:
            words.append(text[start:end])
        start = end
        return size

    while pos < n:
        c = text[pos]
        letter, number, space = _flags(text, pos)
        if c == "'" and pos + 1 < n:
            c1 = text[pos + 1].lower() if llama3 else text[pos + 1]
            if c1 in "stmd":
                pos += add(pos + 2)
                continue
            if pos + 2 < n:
                c2 = text[pos + 2].lower() if llama3 else text[pos + 2]
                if c1 + c2 in ("re", "ve", "ll"):
                    pos += add(pos + 3)
                    continue
        if llama3:
            if c not in "\r\n" and not number and (letter or _flags(text, pos + 1)[0]):
                pos += 1
                while _flags(text, pos)[0]:
                    pos += 1
                add(pos)
                continue
            if number:
                first = pos
                while _flags(text, pos)[1]:
                    pos += 1
                    if pos - first >= 3:
                        add(pos)
                        first = pos
                add(pos)
                continue
        else:
            l2, n2, _ = _flags(text, pos + 1) if c == " " else (letter, number, space)
            if l2 or n2:
                pos += c == " "
                while _flags(text, pos)[0 if l2 else 1]:
                    pos += 1
                add(pos)
                continue
        q = pos + 1 if c == " " else pos
        if not any(_flags(text, q)) and _defined(text, q if not llama3 else pos):
            pos = q
            while not any(_flags(text, pos)) and _defined(text, pos):
                pos += 1
            while llama3 and pos < n and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        n_space, last_newline = 0, 0
        while _flags(text, pos + n_space)[2]:
            if llama3 and text[pos + n_space] in "\r\n":
                last_newline = pos + n_space + 1
            n_space += 1
        if last_newline:
            pos = last_newline
        elif n_space > 1 and pos + n_space < n:
            pos += n_space - 1
        elif n_space:
            pos += n_space
        else:
            pos += 1
        add(pos)
    return words


_ALPHABET = list("aZk's'StTdDmMlLrReEvV 0123456789 .,!?-_$+<=>^~`|\"'()[]{}#@%&*/\\:;") + [
    " ", " ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x00", "\x1f", "\x7f", "\u0085",
    "\u00a0", "\u2028", "\u3000", "\u200b", "\ufeff", "é", "ß", "Ж", "ж", "ع", "日", "本", "ą",
    "\u0301", "\u0903", "٣", "²", "½", "Ⅻ", "©", "€", "→", "🍕", "👍🏽", "\U0001d54f", "\ue000",
    "\uffff", "\U0010ffff", "\ufffd", "İ", "K",
]


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.mark.parametrize("name, llama3", [("gpt2", False), ("llama3", True)])
def test_collapsed_regex_equals_llama_cpp_custom_matcher(name, llama3):
    pre = pre_tokenizer(name)
    for text in _random_texts(seed=len(name), count=3000):
        assert pre.split(text) == _llama_cpp_custom_split(text, llama3), repr(text)


@pytest.mark.parametrize("pre_name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_partitions_the_text(pre_name):
    pre = pre_tokenizer(PRE_TOKENIZERS[pre_name].regexes)
    for text in _random_texts(seed=7, count=200) + ["", "x", "Hello world's 12345 日本語\r\n\n  end  "]:
        words = pre.split(text)
        assert "".join(words) == text
        assert all(words)


@pytest.mark.parametrize("name, text, expected", [
    ("gpt2", "Hello world's  test\n", ["Hello", " world", "'s", " ", " test", "\n"]),
    ("gpt2", "DON'T", ["DON", "'", "T"]),                         # contractions are lowercase only
    ("llama3", "DON'T 1234567", ["DON", "'T", " ", "123", "456", "7"]),
    ("llama3", "x\n\n  y", ["x", "\n\n", " ", " y"]),
    ("starcoder", "ab12 3", ["ab", "1", "2", " ", "3"]),          # smollm: one token per digit
    ("qwen2", "x 123", ["x", " ", "1", "2", "3"]),
    ("gpt-4o", "HelloWorld's ÉTÉ", ["Hello", "World's", " ÉTÉ"]),
    ("default", "a+=b 1234", ["a", "+=", "b", " ", "123", "4"]),
    ("falcon", "x=1; y", ["x", "=", "1", ";", " y"]),
    ("deepseek-llm", "Hi 世界 42\n", ["Hi", " ", "世界", " ", "42", "\n"]),
    ("deepseek-v3", "ab,cd 12345", ["ab", ",cd", " ", "123", "45"]),
    ("bloom", "Hi, you", ["Hi", ",", " you"]),
])
def test_known_splits(name, text, expected):
    assert pre_tokenizer(name).split(text) == expected


def test_collapse_regex_like_llama_cpp():
    assert collapse_regex(r"[^\s\p{L}\p{N}]+") == "[^\\s\xd2A-Za-z\xd10-9]+"
    assert collapse_regex(r"\p{N}{1,3}") == "[\xd10-9]{1,3}"
    assert collapse_regex(r"[\p{P}\$]") == "[\xd3!-#%-*,-/:-;?-@\\[-\\]_\\{\\}\\$]"
    assert collapse_regex(r"\[\p{M}\]") == "\\[[\xd4]\\]"


def test_collapse_classes():
    assert collapse("a1 ~") == "a1 ~"
    assert collapse("é٣\u00a0\u3000✓\u0301、\u200b\ue000") == "\xd2\xd1\x0b\x0b\xd5\xd4\xd3\xd0\xd0"


@pytest.mark.parametrize("data, text", [
    (b"ok \xe2\x82\xac", "ok €"),
    (b"\xff", "\ufffd"),
    (b"\x80\x80", "\ufffd\ufffd"),
    (b"\xe2\x82", "\ufffd\ufffd"),                # cut short: each byte on its own
    (b"\xe2\x28\xa1", "\ufffd(\ufffd"),
    (b"\xed\xa0\x80", "\ud800"),                  # surrogates and overlong forms are accepted
    (b"\xc0\x80", "\x00"),
    (b"\xf4\x90\x80\x80", "\ufffd"),              # beyond U+10FFFF
    (b"\xf8\x88\x80\x80\x80", "\ufffd" * 5),
])
def test_decode_utf8_like_llama_cpp(data, text):
    assert decode_utf8(data) == text


def test_gpt2_byte_map():
    assert len(set(BYTE_TO_CHAR)) == 256
    assert byte_encode(b" \n!\xff\x00") == "\u0120\u010a!\u00ff\u0100"


def test_qwen35_keeps_combining_marks_in_words():
    """Qwen3.5's regex (letters and marks together; marks out of the punctuation runs) splits
    as its tokenizer.json regex does under a full Unicode engine, where Qwen2's breaks words
    at combining marks."""
    original = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    text = "cafe\u0301 na\u0308ive 123 x\u0301!? don't \u0915\u093f\u0924\u093e\u092c\n\n  end"
    assert pre_tokenizer("qwen35").split(text) == regex.findall(original, text)
    assert "cafe" in pre_tokenizer("qwen2").split(text)
    rng = random.Random(35)
    alphabet = "ab \n'1!\u0301\u0308\u093f\u0915é"
    for _ in range(200):
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert pre_tokenizer("qwen35").split(t) == regex.findall(original, t), repr(t)
