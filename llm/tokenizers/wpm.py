"""WordPiece tokenizer of BERT-style models (llama.cpp's `llm_tokenizer_wpm_session`).

GGUF WordPiece vocabularies mark word starts, not continuations: a word-initial piece is
stored as "\u2581" + piece and a continuation piece as itself (convert_hf_to_gguf drops "##").

The text is decoded as llama.cpp decodes it (bad bytes -> U+FFFD), optionally NFD-mapped
(strip_accents: each code point to the first code point of its canonical decomposition, as
llama.cpp's one-to-one table does), then split into words: whitespace ends a word; NUL,
U+FFFD and control characters are dropped; accent marks are dropped when stripping accents;
punctuation, ASCII symbols and CJK ideographs are words of their own; characters are
lowercased (to the first code point of the lowercase mapping) when asked.

Each word, with "\u2581" prepended, is cut greedily into the longest vocabulary pieces from
left to right (byte positions, as llama.cpp does); a word with a position where no piece
matches becomes the unknown token.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache

import regex

from llm.tokenizers.unicode import decode_utf8

ESCAPED_SPACE = "\u2581".encode()

_CATEGORY = regex.compile(r"(\p{N})|(\p{L})|(\p{Z})|(\p{M})|(\p{P})|(\p{S})|(\p{C})")
_WHITESPACE = regex.compile(r"\s")
_NUMBER, _LETTER, _SEPARATOR, _ACCENT, _PUNCT, _SYMBOL, _CONTROL = range(1, 8)
_SKIP, _SPACE, _ALONE, _APPEND = range(4)


def is_chinese_char(cp: int) -> bool:
    """The CJK ranges BERT splits into one-character words (llama.cpp keeps HF's 0x2B920 start)."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


@lru_cache(maxsize=1 << 16)
def _category(ch: str) -> int:
    """llama.cpp's class of a code point; unassigned ones (Cn, e.g. U+FFFF) have none there,
    so they are not dropped as controls but kept (and become [UNK])."""
    if unicodedata.category(ch) == "Cn":
        return 0
    m = _CATEGORY.match(ch)
    return m.lastindex if m else 0


@lru_cache(maxsize=1 << 16)
def nfd_first(ch: str) -> str:
    """unicode_cpts_normalize_nfd for one code point: the first of its NFD decomposition."""
    return unicodedata.normalize("NFD", ch)[0]


def to_lower(ch: str) -> str:
    """unicode_tolower: the first code point of the lowercase mapping."""
    low = ch.lower()
    return low[0] if low else ch


@lru_cache(maxsize=1 << 16)
def _action(ch: str, lowercase: bool, strip_accents: bool) -> tuple[int, str]:
    """What preprocess does with one (already NFD-mapped) character."""
    if _WHITESPACE.match(ch):
        return _SPACE, ""
    cat = _category(ch)
    cp = ord(ch)
    if cp == 0 or cp == 0xFFFD or cat == _CONTROL:
        return _SKIP, ""
    if strip_accents and cat == _ACCENT:
        return _SKIP, ""
    s = to_lower(ch) if lowercase else ch
    if cat == _PUNCT or (cp < 0x7F and cat == _SYMBOL) or is_chinese_char(cp):
        return _ALONE, s
    return _APPEND, s


def preprocess(text: bytes, lowercase: bool, strip_accents: bool) -> list[str]:
    """The words of a text fragment (llm_tokenizer_wpm_session::preprocess)."""
    chars = decode_utf8(text)
    words: list[str] = []
    cur: list[str] = []
    for ch in chars:
        if strip_accents:
            ch = nfd_first(ch)
        action, s = _action(ch, lowercase, strip_accents)
        if action == _APPEND:
            cur.append(s)
        elif action == _SPACE:
            if cur:
                words.append("".join(cur))
                cur = []
        elif action == _ALONE:
            if cur:
                words.append("".join(cur))
                cur = []
            words.append(s)
    if cur:
        words.append("".join(cur))
    return words


class WPMTokenizer:
    def __init__(self, token_to_id: dict[bytes, int], unk: int, lowercase: bool, strip_accents: bool):
        self.token_to_id = token_to_id
        self.unk = unk
        self.lowercase = lowercase
        self.strip_accents = strip_accents
        self.max_token_len = max((len(t) for t in token_to_id), default=0)
        self.cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: bytes) -> list[int]:
        out: list[int] = []
        for word in preprocess(text, self.lowercase, self.strip_accents):
            ids = self.cache.get(word)
            if ids is None:
                ids = self.cache[word] = self._word(word)
            out.extend(ids)
        return out

    def _word(self, word: str) -> tuple[int, ...]:
        """Greedy longest match over the bytes of "\u2581" + word; unk when stuck."""
        w = ESCAPED_SPACE + word.encode("utf-8", "surrogatepass")
        n = len(w)
        out: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + self.max_token_len + 1), i, -1):
                tid = self.token_to_id.get(w[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                out = []
                break
        if not out:
            return (self.unk,)
        return tuple(out)
