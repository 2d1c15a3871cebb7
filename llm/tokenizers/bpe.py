"""Byte-level BPE tokenizer (llama.cpp's `llm_tokenizer_bpe_session`).

A text fragment is decoded the way llama.cpp decodes it, split into words by the
pre-tokenizer, and every word is written as GPT-2 byte-level characters (one printable
character per UTF-8 byte), or kept as its characters where the pre-tokenizer says so
(Gemma 4's SPM-style BPE). Within a word the adjacent pair with the lowest merge rank is
merged first (ties: the leftmost) until no pair has a rank. A final symbol that is not a
token is replaced by the tokens of its single bytes where they exist ("<0xXX>" tokens
without the byte-level encoding) and dropped otherwise, as llama.cpp does. Results are
cached per word.

Vocabulary texts here are `str`: GGUF strings decoded as UTF-8 with `surrogateescape`, so a
text that is not valid UTF-8 still has exactly one spelling.
"""
from __future__ import annotations

import heapq

from llm.tokenizers.pretokenize import PreTokenizer
from llm.tokenizers.unicode import byte_encode, decode_utf8, encode_utf8

_CACHE_LIMIT = 1 << 17


def parse_merges(merges: list[str]) -> dict[tuple[str, str], int]:
    """Merge ranks from `tokenizer.ggml.merges`: "left right" split at the first space after
    the first character; a repeated pair keeps its first (lowest) rank."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        pos = merge.find(" ", 1)
        pair = (merge[:pos], merge[pos + 1:]) if pos != -1 else ("", "")
        ranks.setdefault(pair, rank)
    return ranks


class BPETokenizer:
    def __init__(self, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int],
                 pre_tokenizer: PreTokenizer, ignore_merges: bool, *, byte_encode: bool = True,
                 whole_newlines: bool = False):
        self.token_to_id = token_to_id
        self.ranks = ranks
        self.pre_tokenizer = pre_tokenizer
        self.ignore_merges = ignore_merges
        self.byte_encode = byte_encode
        self.whole_newlines = whole_newlines
        # llama.cpp looks up each byte of an unknown symbol's UTF-8 as a one-byte token text,
        # or as "<0xXX>" without the byte-level encoding.
        if byte_encode:
            byte_texts = [bytes([b]).decode("utf-8", "surrogateescape") for b in range(256)]
        else:
            byte_texts = [f"<0x{b:02X}>" for b in range(256)]
        self.byte_tokens = [token_to_id.get(t) for t in byte_texts]
        self.cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: bytes) -> list[int]:
        """Token ids of a raw text fragment (UTF-8 bytes, possibly invalid)."""
        out: list[int] = []
        cache = self.cache
        for word in self.pre_tokenizer.split(decode_utf8(text)):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = self._word(word)
            out.extend(ids)
        return out

    def _word(self, word: str) -> tuple[int, ...]:
        encoded = byte_encode(encode_utf8(word)) if self.byte_encode else word
        if self.ignore_merges and encoded in self.token_to_id:
            return (self.token_to_id[encoded],)
        if self.whole_newlines and encoded in self.token_to_id and not encoded.strip("\n"):
            return (self.token_to_id[encoded],)
        out: list[int] = []
        for symbol in self._merge(list(encoded)):
            tid = self.token_to_id.get(symbol)
            if tid is not None:
                out.append(tid)
                continue
            for b in encode_utf8(symbol):
                byte_token = self.byte_tokens[b]
                if byte_token is not None:
                    out.append(byte_token)
        return tuple(out)

    def _merge(self, symbols: list[str]) -> list[str]:
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self.ranks
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        queue: list[tuple[int, int, int, str]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

        for k in range(1, n):
            add_bigram(k - 1, k)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue
            symbols[left] = merged
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add_bigram(prv[left], left)
            add_bigram(left, nxt[left])
        return [s for s in symbols if s]
