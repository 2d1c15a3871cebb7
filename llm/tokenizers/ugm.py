"""Unigram tokenizer of T5-style models (llama.cpp's `llm_tokenizer_ugm_session`).

Normalization walks the text prefix by prefix: a user-defined token is kept as is; else the
longest prefix found in the precompiled charsmap (SentencePiece's XOR-compressed double
array, `tokenizer.ggml.precompiled_charsmap`) is replaced by its string; else one UTF-8
character is kept (a bad byte becomes U+FFFD). Spaces become "\u2581" (escape_whitespaces),
one is prepended before the first non-space (add_space_prefix), and runs of spaces collapse
(remove_extra_whitespaces).

Tokenization is SentencePiece's Viterbi search: at each character boundary, every vocabulary
piece (normal, user-defined with score 0, unused) starting there extends the best path to
its end; a character no single piece covers costs the unknown score (lowest normal score
minus 10, in float32 as llama.cpp computes it). Scores add up in float64; a later candidate
replaces the best only when strictly better. Consecutive unknown tokens collapse into one.
"""
from __future__ import annotations

import struct

import numpy as np

from llm.errors import ModelLoadError

ESCAPED_SPACE = "\u2581".encode()
REPLACEMENT = "\ufffd".encode()


def _utf8_char_len(text: bytes, i: int) -> int:
    """Length of the well-formed-enough sequence at i (unicode_cpt_from_utf8), 0 if invalid."""
    b0 = text[i]
    if b0 < 0x80:
        return 1
    if not b0 & 0x40:
        return 0
    size = 2 if not b0 & 0x20 else 3 if not b0 & 0x10 else 4 if not b0 & 0x08 else 0
    if size == 0 or i + size > len(text):
        return 0
    if any(text[j] & 0xC0 != 0x80 for j in range(i + 1, i + size)):
        return 0
    return size


def _utf8_len(lead: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


class CharsMap:
    """The precompiled charsmap: an XCDA trie over input prefixes and the replacement strings."""

    def __init__(self, blob: bytes, path: str):
        if len(blob) < 4:
            raise ModelLoadError(f"{path}: precompiled_charsmap is too small for its header")
        (xcda_size,) = struct.unpack_from("<I", blob, 0)
        if xcda_size + 4 >= len(blob):
            raise ModelLoadError(f"{path}: precompiled_charsmap: XCDA size {xcda_size} exceeds the blob")
        self.xcda = np.frombuffer(blob, "<u4", xcda_size // 4, 4).tolist()
        self.replacements = blob[4 + xcda_size:]

    def _node(self, i: int) -> int:
        if i >= len(self.xcda):
            raise ValueError("index out of bounds in the charsmap's XCDA array")
        return self.xcda[i]

    def _base(self, i: int) -> int:
        n = self._node(i)
        return (n >> 10) << ((n & (1 << 9)) >> 6)

    def longest_prefix(self, text: bytes, start: int) -> tuple[int, bytes]:
        """(bytes matched, replacement) of the longest mapped prefix at `start`; (0, b"") if none."""
        best_len, best_off = 0, 0
        node = self._base(0)
        for pos in range(start, len(text)):
            c = text[pos]
            if c == 0:
                break
            node ^= c
            packed = self._node(node)
            if packed & ((1 << 31) | 0xFF) != c:
                break
            is_leaf = (packed >> 8) & 1
            node ^= self._base(node)
            if is_leaf:
                best_len = pos - start + 1
                best_off = self._node(node) & ((1 << 31) - 1)
        if best_len == 0:
            return 0, b""
        if best_off >= len(self.replacements):
            raise ValueError("index out of bounds in the precompiled charsmap")
        end = self.replacements.find(b"\0", best_off)
        if end < 0:
            raise ValueError("unterminated string in the precompiled charsmap")
        return best_len, self.replacements[best_off:end]


class UGMTokenizer:
    def __init__(self, texts: list[bytes], scores: list[float], normal: list[bool], user_defined: list[bool],
                 unused: list[bool], unk: int, charsmap: CharsMap | None, *, add_space_prefix: bool,
                 remove_extra_whitespaces: bool, escape_whitespaces: bool = True,
                 treat_whitespace_as_suffix: bool = False):
        self.unk = unk
        self.charsmap = charsmap
        self.space = ESCAPED_SPACE if escape_whitespaces else b" "
        self.prepend = add_space_prefix and not treat_whitespace_as_suffix
        self.append = add_space_prefix and treat_whitespace_as_suffix
        self.merge_spaces = remove_extra_whitespaces
        self.pieces: dict[bytes, tuple[int, float]] = {}
        self.user: set[bytes] = set()
        min_score = np.float32(np.inf)
        for i, t in enumerate(texts):
            if normal[i]:
                min_score = min(min_score, np.float32(scores[i]))
            if normal[i] or user_defined[i] or unused[i]:
                self.pieces[t] = (i, 0.0 if user_defined[i] else float(np.float32(scores[i])))
            if user_defined[i]:
                self.user.add(t)
        if not np.isfinite(min_score):
            min_score = np.float32(np.finfo(np.float32).max)
        self.unk_score = float(np.float32(min_score - np.float32(10.0)))
        self.max_len = max((len(t) for t in self.pieces), default=0)
        self.max_user = max((len(t) for t in self.user), default=0)

    def _normalize_prefix(self, text: bytes, i: int) -> tuple[bytes, int]:
        for n in range(min(self.max_user, len(text) - i), 0, -1):
            if text[i:i + n] in self.user:
                return text[i:i + n], n
        if self.charsmap is not None:
            n, repl = self.charsmap.longest_prefix(text, i)
            if n:
                return repl, n
        n = _utf8_char_len(text, i)
        if n == 0:
            return REPLACEMENT, 1
        return text[i:i + n], n

    def normalize(self, text: bytes) -> bytes:
        out = bytearray()
        prepended = False
        in_word = False
        i = 0
        while i < len(text):
            norm, consumed = self._normalize_prefix(text, i)
            for c in norm:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self.prepend and not prepended) or self.merge_spaces:
                            out += self.space
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self.merge_spaces:
                        out += self.space
            i += consumed
        if self.append:
            out += self.space
        return bytes(out)

    def tokenize(self, text: bytes) -> list[int]:
        norm = self.normalize(text)
        n = len(norm)
        if n == 0:
            return []
        best_score = [-np.inf] * (n + 1)
        best_tok = [self.unk] * (n + 1)
        best_from = [0] * (n + 1)
        best_score[0] = 0.0
        pieces = self.pieces
        i = 0
        while i < n:
            n_char = min(_utf8_len(norm[i]), n - i)
            here = best_score[i]
            single = False
            for end in range(i + 1, min(n, i + self.max_len) + 1):
                hit = pieces.get(norm[i:end])
                if hit is None:
                    continue
                if end - i == n_char:
                    single = True
                score = here + hit[1]
                if score > best_score[end]:
                    best_score[end], best_tok[end], best_from[end] = score, hit[0], i
            if not single:
                end = i + n_char
                score = here + self.unk_score
                if score > best_score[end]:
                    best_score[end], best_tok[end], best_from[end] = score, self.unk, i
            i += n_char
        out: list[int] = []
        pos = n
        prev_unk = False
        while True:
            tok = best_tok[pos]
            is_unk = tok == self.unk
            if not (prev_unk and is_unk):
                out.append(tok)
            if best_from[pos] == 0:
                break
            prev_unk = is_unk
            pos = best_from[pos]
        out.reverse()
        return out
