"""The vocabulary of a GGUF model and its tokenizer (llama.cpp's `llama_vocab`).

`load_vocab(ml)` follows `llama_vocab::impl::load`: the tokenizer model picks the
algorithm (`llama` -> SPM, `gpt2` -> BPE, `bert` -> WPM, `t5` -> UGM), `tokenizer.ggml.pre`
picks the BPE word splitting,
token types become attributes, special token ids come from their keys and from the token
texts llama.cpp recognizes (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, `</s>`, ...), and the
end-of-generation set is built the same way. Tokenizing, pieces and detokenizing follow
`llama_tokenize`, `llama_token_to_piece` and `llama_detokenize` exactly, including special
token partitioning (control tokens only with `parse_special`, user-defined tokens always).

Token ids are ints; `LLAMA_TOKEN_NULL` (-1) means "no such token", as in llama.cpp.
Token texts are kept as raw bytes (GGUF strings are bytes; a few are not valid UTF-8).

Known difference: where several tokens match a recognized text (SmolLM2 has both
`<|endoftext|>` and `<|im_end|>` for EOT), llama.cpp takes the first in its hash map's
order; we take the lowest id, which is what llama.cpp picked for the reference models.
"""
from __future__ import annotations

import codecs
import enum
import functools
import gc
import hashlib
import logging
import os
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ggmlx import flags
from ggmlx.compile import hash_sources, write_cache_file
from llm.arch import LLMKV
from llm.loader import GGUFMeta
from llm.tokenizers.bpe import BPETokenizer, parse_merges
from llm.tokenizers.pretokenize import PRE_TOKENIZERS, PreTokenizerSpec, pre_tokenizer
from llm.tokenizers.spm import ESCAPED_SPACE, SPMTokenizer
from llm.tokenizers.ugm import CharsMap, UGMTokenizer
from llm.tokenizers.unicode import CHAR_TO_BYTE, decode_utf8
from llm.tokenizers.wpm import WPMTokenizer

LLAMA_TOKEN_NULL = -1


class VocabType(enum.IntEnum):
    """llama_vocab_type."""

    NONE = 0
    SPM = 1
    BPE = 2
    WPM = 3
    UGM = 4
    RWKV = 5
    PLAMO2 = 6


class TokenType(enum.IntEnum):
    """llama_token_type: the values of `tokenizer.ggml.token_type`."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """llama_token_attr bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# Plain ints for the per-token loops (IntFlag arithmetic is slow over 262144 tokens).
_UNKNOWN, _UNUSED, _NORMAL, _CONTROL = (int(TokenAttr.UNKNOWN), int(TokenAttr.UNUSED),
                                        int(TokenAttr.NORMAL), int(TokenAttr.CONTROL))
_USER_DEFINED, _BYTE, _LSTRIP, _RSTRIP = (int(TokenAttr.USER_DEFINED), int(TokenAttr.BYTE),
                                          int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP))
_ATTR_OF_TYPE = {                       # token type -> attribute; anything else: UNDEFINED
    int(TokenType.UNKNOWN): _UNKNOWN,
    int(TokenType.UNUSED): _UNUSED,
    int(TokenType.NORMAL): _NORMAL,
    int(TokenType.CONTROL): _CONTROL,
    int(TokenType.USER_DEFINED): _USER_DEFINED,
    int(TokenType.BYTE): _BYTE,
}
_SPECIAL_ATTRS = _CONTROL | _USER_DEFINED | _UNKNOWN    # partitioned out of the text
_HIDDEN_ATTRS = _UNKNOWN | _CONTROL                     # empty piece unless special=True

# Texts by which llama.cpp recognizes special tokens that the metadata does not name.
_DS_END_OF_SENTENCE = "<\uff5cend\u2581of\u2581sentence\uff5c>"
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", _DS_END_OF_SENTENCE,
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                  "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                  "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                  "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", _DS_END_OF_SENTENCE, "[e~[")
_ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

# C isspace(): what llama.cpp strips around LSTRIP/RSTRIP special tokens.
_C_SPACES = b" \t\n\v\f\r"


@dataclass
class SpecialTokens:
    """Special token ids (LLAMA_TOKEN_NULL where the vocabulary has none)."""

    bos: int = LLAMA_TOKEN_NULL
    eos: int = LLAMA_TOKEN_NULL
    eot: int = LLAMA_TOKEN_NULL
    eom: int = LLAMA_TOKEN_NULL
    unk: int = LLAMA_TOKEN_NULL
    sep: int = LLAMA_TOKEN_NULL
    pad: int = LLAMA_TOKEN_NULL
    mask: int = LLAMA_TOKEN_NULL
    nl: int = LLAMA_TOKEN_NULL
    fim_pre: int = LLAMA_TOKEN_NULL
    fim_suf: int = LLAMA_TOKEN_NULL
    fim_mid: int = LLAMA_TOKEN_NULL
    fim_pad: int = LLAMA_TOKEN_NULL
    fim_rep: int = LLAMA_TOKEN_NULL
    fim_sep: int = LLAMA_TOKEN_NULL


@dataclass
class TokenizerFlags:
    """The tokenizer switches llama.cpp derives from the model type, the pre-tokenizer and keys."""

    add_space_prefix: bool = False
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False
    ignore_merges: bool = False
    clean_spaces: bool = False        # detokenize: clean_up_tokenization_spaces
    remove_extra_whitespaces: bool = False
    escape_whitespaces: bool = True


# Keys of the special token ids, in llama.cpp's reading order; the deprecated
# prefix/suffix/middle keys override the fim ones when both are present.
_SPECIAL_ID_KEYS = (
    (LLMKV.TOKENIZER_BOS_ID, "bos"), (LLMKV.TOKENIZER_EOS_ID, "eos"),
    (LLMKV.TOKENIZER_EOT_ID, "eot"), (LLMKV.TOKENIZER_EOM_ID, "eom"),
    (LLMKV.TOKENIZER_UNK_ID, "unk"), (LLMKV.TOKENIZER_SEP_ID, "sep"),
    (LLMKV.TOKENIZER_PAD_ID, "pad"), (LLMKV.TOKENIZER_MASK_ID, "mask"),
    (LLMKV.TOKENIZER_FIM_PRE_ID, "fim_pre"), (LLMKV.TOKENIZER_FIM_SUF_ID, "fim_suf"),
    (LLMKV.TOKENIZER_FIM_MID_ID, "fim_mid"), (LLMKV.TOKENIZER_FIM_PAD_ID, "fim_pad"),
    (LLMKV.TOKENIZER_FIM_REP_ID, "fim_rep"), (LLMKV.TOKENIZER_FIM_SEP_ID, "fim_sep"),
    (LLMKV.TOKENIZER_PREFIX_ID, "fim_pre"), (LLMKV.TOKENIZER_SUFFIX_ID, "fim_suf"),
    (LLMKV.TOKENIZER_MIDDLE_ID, "fim_mid"),
)


@dataclass(eq=False)
class Vocab:
    """A loaded vocabulary; build it with `load_vocab`. See the module docstring."""

    path: str
    type: VocabType
    tokenizer_model: str                 # tokenizer.ggml.model
    tokenizer_pre: str                   # tokenizer.ggml.pre ("default" when absent)
    texts: list[bytes] = field(repr=False)
    scores: list[float] = field(repr=False)
    attrs: list[int] = field(repr=False)  # TokenAttr bits per token
    special: SpecialTokens
    flags: TokenizerFlags
    eog_ids: frozenset[int]
    n_merges: int
    tokenizer: SPMTokenizer | BPETokenizer | WPMTokenizer | UGMTokenizer = field(repr=False)
    token_to_id: dict[bytes, int] = field(repr=False)

    def __post_init__(self) -> None:
        # cache_special_tokens: longest text first (ties by id, for a stable order).
        special = np.flatnonzero(np.asarray(self.attrs, dtype=np.int64) & _SPECIAL_ATTRS).tolist()
        order = sorted(special, key=lambda i: (-len(self.texts[i]), i))
        self._special_matchers = {
            True: _SpecialMatcher(order, self.texts),
            False: _SpecialMatcher([i for i in order if not self.attrs[i] & _HIDDEN_ATTRS], self.texts),
        }
        self._pieces: list[bytes | None] = [None] * len(self.texts)

    # --- properties named as in llama.cpp's llama_vocab_* API -------------------------

    @property
    def n_tokens(self) -> int:
        return len(self.texts)

    @property
    def bos(self) -> int:
        return self.special.bos

    @property
    def eos(self) -> int:
        return self.special.eos

    @property
    def eot(self) -> int:
        return self.special.eot

    @property
    def eom(self) -> int:
        return self.special.eom

    @property
    def unk(self) -> int:
        return self.special.unk

    @property
    def sep(self) -> int:
        return self.special.sep

    @property
    def pad(self) -> int:
        return self.special.pad

    @property
    def mask(self) -> int:
        return self.special.mask

    @property
    def nl(self) -> int:
        return self.special.nl

    # FIM tokens (llama_vocab_fim_pre, ...): LLAMA_TOKEN_NULL when the model has none
    @property
    def fim_pre(self) -> int:
        return self.special.fim_pre

    @property
    def fim_suf(self) -> int:
        return self.special.fim_suf

    @property
    def fim_mid(self) -> int:
        return self.special.fim_mid

    @property
    def fim_pad(self) -> int:
        return self.special.fim_pad

    @property
    def fim_rep(self) -> int:
        return self.special.fim_rep

    @property
    def fim_sep(self) -> int:
        return self.special.fim_sep

    @property
    def add_bos(self) -> bool:
        return self.flags.add_bos

    @property
    def add_eos(self) -> bool:
        return self.flags.add_eos

    @property
    def add_sep(self) -> bool:
        return self.flags.add_sep

    @property
    def add_space_prefix(self) -> bool:
        return self.flags.add_space_prefix

    # --- token properties --------------------------------------------------------------

    def _check(self, token: int) -> int:
        if not 0 <= token < len(self.texts):
            raise ValueError(f"token id {token} is out of range [0, {len(self.texts)})")
        return token

    def token_get_text(self, token: int) -> bytes:
        return self.texts[self._check(token)]

    def token_get_score(self, token: int) -> float:
        return self.scores[self._check(token)]

    def token_get_attr(self, token: int) -> TokenAttr:
        return TokenAttr(self.attrs[self._check(token)])

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def is_control(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _CONTROL)

    def is_normal(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _NORMAL)

    def is_unknown(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _UNKNOWN)

    def is_byte(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _BYTE)

    def is_user_defined(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _USER_DEFINED)

    def is_unused(self, token: int) -> bool:
        return bool(self.attrs[self._check(token)] & _UNUSED)

    def text_to_token(self, text: str | bytes) -> int:
        """The id of the token with exactly this text, or LLAMA_TOKEN_NULL."""
        if isinstance(text, str):
            text = text.encode("utf-8", "surrogateescape")
        return self.token_to_id.get(text, LLAMA_TOKEN_NULL)

    # --- tokenize ----------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        """llama_tokenize: token ids of `text` (str, or UTF-8 bytes that may be invalid).

        `add_special` adds BOS/EOS as the model asks (add_bos / add_eos); `parse_special`
        lets control tokens spelled in the text become their ids (user-defined tokens
        always do). Never raises on the content of the text.
        """
        raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
        fragments = self._partition(raw, parse_special) if raw else []
        out: list[int] = []
        if self.type == VocabType.WPM:
            # llama.cpp's WPM path adds [CLS] ... [SEP] whenever add_special, whatever add_bos says
            out = [self.special.bos] if add_special else []
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self.tokenizer.tokenize(frag))
            if add_special:
                out.append(self.special.sep)
            return out
        if add_special and self.flags.add_bos:
            out.append(self.special.bos)
        if self.type == VocabType.SPM:
            is_prev_special = True        # a space prefix goes before the first fragment
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    is_prev_special = True
                    continue
                if self.flags.add_space_prefix and is_prev_special:
                    frag = b" " + frag
                out.extend(self.tokenizer.tokenize(frag.replace(b" ", ESCAPED_SPACE)))
                is_prev_special = False
        else:
            escape = self.type == VocabType.BPE and self.flags.escape_whitespaces
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self.tokenizer.tokenize(frag.replace(b" ", ESCAPED_SPACE) if escape else frag))
        if add_special and self.flags.add_eos:
            out.append(self.special.eos)
        return out

    def _partition(self, raw: bytes, parse_special: bool) -> list[bytes | int]:
        """tokenizer_st_partition: cut special tokens out of the text, longest token first.

        Each token splits every text fragment left by the longer ones at all its
        non-overlapping occurrences (leftmost first); LSTRIP / RSTRIP tokens also eat the
        whitespace before / after them. Only tokens that occur somewhere in the text are
        tried, which gives the same result much faster.
        """
        fragments: list[bytes | int] = [raw]
        for tid in self._special_matchers[parse_special].occurring(raw):
            tok = self.texts[tid]
            attr = self.attrs[tid]
            out: list[bytes | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                else:
                    _split_fragment(frag, tok, tid, bool(attr & _LSTRIP),
                                    bool(attr & _RSTRIP), out)
            fragments = out
        return fragments

    # --- pieces and detokenize ---------------------------------------------------------

    def token_to_piece(self, token: int, lstrip: int = 0, special: bool = False) -> bytes:
        """llama_token_to_piece: the bytes of one token.

        Control and unknown tokens give b"" unless `special`; `lstrip` removes up to that
        many leading spaces. Byte tokens give one byte, which may be part of a UTF-8
        character (see TokenStreamDecoder).
        """
        attr = self.attrs[self._check(token)]
        if not special and attr & _HIDDEN_ATTRS:
            return b""
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = self._render(token)
        for _ in range(lstrip):
            if not piece.startswith(b" "):
                break
            piece = piece[1:]
        return piece

    def _render(self, token: int) -> bytes:
        """The piece llama.cpp caches for a token (the special=True rendering)."""
        attr = self.attrs[token]
        text = self.texts[token]
        if attr & (_HIDDEN_ATTRS | _USER_DEFINED):
            return text
        if attr & _NORMAL:
            if self.flags.escape_whitespaces:
                return text.replace(ESCAPED_SPACE, b" ")
            return _decode_byte_level(text)
        if attr & _BYTE:
            return bytes([_hex_byte(text)])
        return b""

    def detokenize_bytes(self, tokens: Iterable[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        """llama_detokenize, byte for byte.

        `remove_special` drops a leading BOS / trailing EOS that add_special would have
        added; `unparse_special` renders control tokens as their text. The space prefix
        of SPM models is removed from the first piece.
        """
        tokens = list(tokens)
        remove_space = self.flags.add_space_prefix
        if remove_special and self.flags.add_bos and tokens and tokens[0] == self.special.bos:
            remove_space = False
            tokens = tokens[1:]
        if remove_special and self.flags.add_eos and tokens and tokens[-1] == self.special.eos:
            tokens = tokens[:-1]
        parts = []
        for token in tokens:
            parts.append(self.token_to_piece(token, lstrip=int(remove_space), special=unparse_special))
            remove_space = False
        text = b"".join(parts)
        return _clean_spaces(text) if self.flags.clean_spaces else text

    def detokenize(self, tokens: Iterable[int], remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """llama_detokenize as text; bytes that are not valid UTF-8 become U+FFFD."""
        return self.detokenize_bytes(tokens, remove_special, unparse_special).decode("utf-8", "replace")

    def stream_decoder(self, special: bool = False) -> TokenStreamDecoder:
        """An incremental decoder for generated tokens (see TokenStreamDecoder)."""
        return TokenStreamDecoder(self, special=special)


class TokenStreamDecoder:
    """Text of a token stream, one token at a time, never splitting a UTF-8 character.

    A character spread over several tokens (byte tokens, emoji in BPE) is returned once
    its last byte arrives; `flush()` returns what is left (invalid bytes as U+FFFD).
    """

    def __init__(self, vocab: Vocab, special: bool = False):
        self.vocab = vocab
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int, special: bool = False) -> str:
        """The text token adds; a control token's own text when `special` (or the decoder's)."""
        return self._decoder.decode(self.vocab.token_to_piece(token, special=special or self.special))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# --- partition helpers --------------------------------------------------------------------


class _SpecialMatcher:
    """Finds which special tokens occur in a text, with a byte trie of their texts."""

    def __init__(self, order: list[int], texts: list[bytes]):
        self.order = order                # partition order: longest text first
        self.trie: dict = {}              # byte -> child node; key -1: the id ending here
        for tid in order:
            node = self.trie
            for b in texts[tid]:
                node = node.setdefault(b, {})
            node[-1] = tid
        first = b"".join(re.escape(bytes([b])) for b in sorted(k for k in self.trie if k >= 0))
        self.starts = re.compile(b"[" + first + b"]") if first else None

    def occurring(self, raw: bytes) -> list[int]:
        """Ids of the tokens found anywhere in `raw` (overlaps included), in partition order."""
        if self.starts is None:
            return []
        found = set()
        n = len(raw)
        for m in self.starts.finditer(raw):
            node = self.trie.get(raw[m.start()])
            pos = m.start() + 1
            while node is not None:
                if -1 in node:
                    found.add(node[-1])
                node = node.get(raw[pos]) if pos < n else None
                pos += 1
        return [tid for tid in self.order if tid in found] if found else []


def _split_fragment(frag: bytes, tok: bytes, tid: int, lstrip: bool, rstrip: bool,
                    out: list[bytes | int]) -> None:
    """Append the pieces of `frag` cut at every occurrence of `tok` (with its id between)."""
    base, end = 0, len(frag)
    while True:
        match = frag.find(tok, base)
        if match < 0:
            if base < end:
                out.append(frag[base:])
            return
        left = frag[base:match]
        if lstrip:
            left = left.rstrip(_C_SPACES)
        if left:
            out.append(left)
        out.append(tid)
        base = match + len(tok)
        if rstrip:
            while base < end and frag[base] in _C_SPACES:
                base += 1
        if base >= end:
            return


# --- piece helpers ------------------------------------------------------------------------


def _decode_byte_level(text: bytes) -> bytes:
    """llama_decode_text: GPT-2 byte-level characters back to bytes.

    A character outside the byte map is written as llama.cpp writes it:
    "[UNK_BYTE_0x<hex of its UTF-8>" followed by the whole token text and "]".
    """
    out = bytearray()
    for ch in decode_utf8(text):
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogatepass").hex().encode() + text + b"]"
    return bytes(out)


def _hex_byte(text: bytes) -> int:
    """token_to_byte: strtol of the two characters after "<0x" (0 when not hex)."""
    digits = b""
    for c in text[3:5]:
        if chr(c) not in "0123456789abcdefABCDEF":
            break
        digits += bytes([c])
    return int(digits, 16) if digits else 0


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces, in place as llama.cpp does it.

    Removes the space before ?!., , around a lone apostrophe, and before 's 'm 're 've.
    """
    t = bytearray(text)
    space, apostrophe = ord(" "), ord("'")
    total1 = len(t)
    total = 1 if total1 else 0
    for i in range(1, total1):
        x = t[i]
        if t[i - 1] == space and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    total2 = total
    total = 1 if total2 else 0
    i = 1
    while i < total2:
        x = t[i]
        if x == apostrophe and i + 1 < total2 and t[i - 1] == space and t[i + 1] == space:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    total3 = total
    total = 1 if total3 else 0
    for i in range(1, total3):
        x = t[i]
        if t[i - 1] == space and x == apostrophe and i + 1 < total3:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < total3 and bytes(t[i + 1:i + 3]) in (b"re", b"ve"):
                total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


# --- loading ------------------------------------------------------------------------------


log = logging.getLogger(__name__)


@functools.cache
def _vocab_code_version() -> str:
    """hash_sources of what decides a Vocab's contents and its pickled classes (this module, the
    tokenizers, the GGUF metadata reading): an edited or upgraded engine builds it afresh."""
    here = os.path.dirname(__file__)
    tok = os.path.join(here, "tokenizers")
    return hash_sources([os.path.join(here, "vocab.py"), os.path.join(here, "loader.py"),
                         os.path.join(here, "arch.py"), os.path.join(os.path.dirname(here), "ggmlx", "gguf.py")]
                        + sorted(os.path.join(tok, n) for n in os.listdir(tok) if n.endswith(".py")))


def _vocab_cache_path(model_path: str) -> str | None:
    """Where the vocabulary of this model file (by its real path, size and modification time)
    is kept; None when the persistent caches are off or the path is no plain file."""
    if flags.NO_PERSISTENT_CACHE.on():
        return None
    try:
        st = os.stat(model_path)
    except OSError:
        return None
    tag = repr((os.path.realpath(model_path), st.st_size, st.st_mtime_ns, _vocab_code_version()))
    return os.path.join(flags.cache_root(), "vocab", hashlib.sha256(tag.encode()).hexdigest() + ".pkl")


def load_vocab_cached(ml: GGUFMeta) -> Vocab:
    """load_vocab(ml), read back from cache_root()/vocab when an earlier load of the same file by
    the same code stored it (Gemma3's 262144 tokens: 0.09 s unpickled against 0.22 s built; the
    GGUF metadata is read either way). An unreadable entry is built and written again; off with
    GGMLX_NO_PERSISTENT_CACHE=1."""
    path = _vocab_cache_path(ml.path)
    if path is not None and os.path.exists(path):
        try:
            collecting = gc.isenabled()
            gc.disable()        # its 300k objects live as long as the model: no collection in the middle
            try:
                with open(path, "rb") as f:
                    vocab = pickle.load(f)
            finally:
                if collecting:
                    gc.enable()
            if isinstance(vocab, Vocab):
                return vocab
            log.warning("ignoring cached vocabulary %s: it holds a %s", path, type(vocab).__name__)
        except Exception as e:  # a torn or stale entry must never stop a load
            log.warning("ignoring unreadable cached vocabulary %s: %s", path, e)
    vocab = load_vocab(ml)
    if path is not None:
        try:
            data = pickle.dumps(vocab, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # an unpicklable tokenizer only costs the next load its time
            log.warning("could not pickle the vocabulary of %s: %s", ml.path, e)
            return vocab
        write_cache_file(path, data, "the vocabulary")
    return vocab


def load_vocab(ml: GGUFMeta) -> Vocab:
    """The vocabulary from GGUF metadata (a ModelLoader, or `GGUFMeta(kv, path)` over
    `ggmlx.gguf.GGUFReader(path).kv`).

    Raises ModelLoadError naming the key and the file for a missing or mistyped key, an
    unsupported tokenizer model or pre-tokenizer, or an inconsistent vocabulary.
    """
    model = ml.get_key(LLMKV.TOKENIZER_MODEL, str)
    pre = ml.get_key(LLMKV.TOKENIZER_PRE, str, "")
    if model == "gpt2":
        pre = pre or "default"
    elif model == "gemma4":
        pre = "gemma4"          # whatever the file says, as llama.cpp
    vtype, special, flags, merges, spec = _model_defaults(ml, model, pre)
    flags.add_space_prefix = ml.get_key(LLMKV.TOKENIZER_ADD_PREFIX, bool, flags.add_space_prefix)
    flags.remove_extra_whitespaces = ml.get_key(LLMKV.TOKENIZER_REMOVE_EXTRA_WS, bool, False)
    texts, token_to_id, scores, attrs = _read_tokens(ml)
    pad_default = special.pad
    _read_special_ids(ml, special, flags, len(texts))
    if pre == "gemma4" and not flags.add_bos:      # llama.cpp overrides the key for Gemma 4
        if special.bos == LLAMA_TOKEN_NULL:
            raise ml.error(f"Gemma 4 always adds BOS, but '{LLMKV.TOKENIZER_BOS_ID.value}' is not set")
        flags.add_bos = True
    eog_ids = _recognize_special_texts(texts, token_to_id, attrs, special)
    _apply_model_attrs(ml, texts, attrs, token_to_id, pre)
    tokenizer, nl = _make_tokenizer(ml, vtype, texts, token_to_id, scores, attrs, special.unk, flags, merges, spec)
    special.nl = pad_default if nl is None else nl
    return Vocab(path=ml.path, type=vtype, tokenizer_model=model, tokenizer_pre=pre or "default",
                 texts=texts, scores=scores, attrs=attrs, special=special, flags=flags,
                 eog_ids=eog_ids, n_merges=len(merges), tokenizer=tokenizer, token_to_id=token_to_id)


def _model_defaults(ml: GGUFMeta, model: str, pre: str
                    ) -> tuple[VocabType, SpecialTokens, TokenizerFlags, list[str], PreTokenizerSpec | None]:
    """What tokenizer.ggml.model implies before any other key is read, as the `if (tokenizer_model
    == ...)` chain of llama_vocab::impl::load: the vocab type, default special ids and flags, and
    for BPE its merges and pre-tokenizer."""
    special = SpecialTokens()
    flags = TokenizerFlags()
    merges: list[str] = []
    spec = None
    if model == "llama":
        vtype = VocabType.SPM
        special.bos, special.eos, special.unk = 1, 2, 0
        flags.add_space_prefix, flags.add_bos = True, True
    elif model in ("gpt2", "gemma4"):
        vtype = VocabType.BPE
        merges = ml.get_arr(LLMKV.TOKENIZER_MERGES, str)
        if model == "gpt2":         # gemma4's special ids come from the file only
            special.bos, special.eos = 11, 11
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise ml.error(f"key '{LLMKV.TOKENIZER_PRE.value}': unknown or unsupported "
                          f"pre-tokenizer type '{pre}'")
        flags.escape_whitespaces = not spec.byte_encode     # SPM-style BPE spells spaces U+2581
        flags.clean_spaces = spec.clean_spaces
        flags.ignore_merges = spec.ignore_merges
        flags.add_bos = spec.add_bos
        flags.add_sep = spec.add_sep
        if spec.no_bos:
            special.bos = LLAMA_TOKEN_NULL
    elif model == "bert":
        vtype = VocabType.WPM
        special.bos, special.unk, special.sep, special.pad, special.mask = 101, 100, 102, 0, 103
        flags.clean_spaces, flags.add_bos, flags.add_sep = True, True, True
    elif model == "t5":
        vtype = VocabType.UGM
        special.eos, special.unk, special.pad = 1, 2, 0
        flags.add_eos = True
    else:
        raise ml.error(f"key '{LLMKV.TOKENIZER_MODEL.value}': tokenizer model '{model}' is not "
                       f"supported yet (supported: 'llama' = SPM, 'gpt2' and 'gemma4' = BPE, 'bert' = WPM, "
                       f"'t5' = UGM)")
    return vtype, special, flags, merges, spec


def _read_tokens(ml: GGUFMeta) -> tuple[list[bytes], dict[bytes, int], list[float], list[int]]:
    """The token texts (an empty one named [EMPTY_i], a duplicate refused), the text -> id map,
    and each token's score and attributes (from its token type)."""
    raw_texts = ml.get_arr(LLMKV.TOKENIZER_LIST, str)
    n = len(raw_texts)
    # scores and types may list more entries than tokens; only the first n count
    scores = ml.get_arr(LLMKV.TOKENIZER_SCORES, float, [0.0] * n)
    types = ml.get_arr(LLMKV.TOKENIZER_TOKEN_TYPE, int, [int(TokenType.NORMAL)] * n)
    for key, values in ((LLMKV.TOKENIZER_SCORES, scores), (LLMKV.TOKENIZER_TOKEN_TYPE, types)):
        if len(values) < n:
            raise ml.error(f"key '{key.value}' has {len(values)} values for {n} tokens")
    texts = [t.encode("utf-8", "surrogateescape") for t in raw_texts]
    if not all(texts):
        texts = [t or f"[EMPTY_{i}]".encode() for i, t in enumerate(texts)]
    token_to_id = dict(zip(texts, range(n), strict=True))
    if len(token_to_id) < n:         # a duplicate: name the first one
        first: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            if text in first:
                raise ml.error(f"key '{LLMKV.TOKENIZER_LIST.value}': duplicate token {text!r} "
                               f"with ids {first[text]} and {i}")
            first[text] = i
    return texts, token_to_id, scores[:n], _attrs_of_types(types[:n])


def _attrs_of_types(types: list[int]) -> list[int]:
    """Each token type's attribute (_ATTR_OF_TYPE; another value: UNDEFINED), one numpy pass
    per type (a 262144-token vocabulary's per-token lookups were a tenth of its load)."""
    t = np.asarray(types, dtype=np.int64)
    attrs = np.zeros(len(t), dtype=np.int64)
    for token_type, attr in _ATTR_OF_TYPE.items():
        attrs[t == token_type] = attr
    return attrs.tolist()


def _read_special_ids(ml: GGUFMeta, special: SpecialTokens, flags: TokenizerFlags, n: int) -> None:
    """The special-token ids and add_bos/eos/sep keys over the model's defaults; a default id
    beyond the vocabulary is dropped, and adding a token that has no id is refused."""
    for key, name in _SPECIAL_ID_KEYS:
        current = getattr(special, name)
        if current >= n:
            setattr(special, name, LLAMA_TOKEN_NULL)
        new_id = ml.get_key(key, int, LLAMA_TOKEN_NULL)
        if 0 <= new_id < n:
            setattr(special, name, new_id)
    flags.add_bos = ml.get_key(LLMKV.TOKENIZER_ADD_BOS, bool, flags.add_bos)
    flags.add_eos = ml.get_key(LLMKV.TOKENIZER_ADD_EOS, bool, flags.add_eos)
    flags.add_sep = ml.get_key(LLMKV.TOKENIZER_ADD_SEP, bool, flags.add_sep)
    for on, tid, add_key, id_key in (
            (flags.add_bos, special.bos, LLMKV.TOKENIZER_ADD_BOS, LLMKV.TOKENIZER_BOS_ID),
            (flags.add_eos, special.eos, LLMKV.TOKENIZER_ADD_EOS, LLMKV.TOKENIZER_EOS_ID),
            (flags.add_sep, special.sep, LLMKV.TOKENIZER_ADD_SEP, LLMKV.TOKENIZER_SEP_ID)):
        if on and tid == LLAMA_TOKEN_NULL:
            raise ml.error(f"key '{add_key.value}' is true, but '{id_key.value}' is not set")


def _make_tokenizer(ml: GGUFMeta, vtype: VocabType, texts: list[bytes], token_to_id: dict[bytes, int],
                    scores: list[float], attrs: list[int], unk: int, flags: TokenizerFlags, merges: list[str],
                    spec: PreTokenizerSpec | None
                    ) -> tuple[SPMTokenizer | BPETokenizer | WPMTokenizer | UGMTokenizer, int | None]:
    """The tokenizer of the vocab type and the id of the newline token (None: there is none,
    the caller falls back to the model's default pad id, as llama.cpp's linefeed_id does)."""
    if vtype == VocabType.SPM:
        byte_tokens = [_spm_byte_token(token_to_id, b) for b in range(256)]
        nl = byte_tokens[0x0A]
        return SPMTokenizer(token_to_id, scores, byte_tokens, unk), (nl if nl >= 0 else None)
    if vtype == VocabType.WPM:
        lowercase = ml.get_key(LLMKV.TOKENIZER_NORMALIZER_LOWERCASE, bool, True)
        strip_accents = ml.get_key(LLMKV.TOKENIZER_NORMALIZER_STRIP_ACCENTS, bool, lowercase)
        return WPMTokenizer(token_to_id, unk, lowercase, strip_accents), None
    tokenizer: BPETokenizer | UGMTokenizer
    if vtype == VocabType.UGM:
        blob = ml.get_arr(LLMKV.TOKENIZER_PRECOMPILED_CHARSMAP, int, [])
        charsmap = CharsMap(bytes(b & 0xFF for b in blob), ml.path) if blob else None
        tokenizer = UGMTokenizer(texts, scores, [bool(a & _NORMAL) for a in attrs],
                                 [bool(a & _USER_DEFINED) for a in attrs], [bool(a & _UNUSED) for a in attrs],
                                 unk, charsmap, add_space_prefix=flags.add_space_prefix,
                                 remove_extra_whitespaces=flags.remove_extra_whitespaces)
    else:
        assert spec is not None   # _model_defaults sets it for BPE or raises
        str_to_id = {t.decode("utf-8", "surrogateescape"): i for i, t in enumerate(texts)}
        tokenizer = BPETokenizer(str_to_id, parse_merges(merges), pre_tokenizer(spec.regexes),
                                 flags.ignore_merges, byte_encode=spec.byte_encode,
                                 whole_newlines=spec.whole_newlines)
    nl_ids = tokenizer.tokenize(b"\n")
    return tokenizer, (nl_ids[0] if nl_ids else None)


def _spm_byte_token(token_to_id: dict[bytes, int], b: int) -> int:
    """byte_to_token for SPM: "<0xNN>", else the byte itself as a token, else none."""
    tid = token_to_id.get(f"<0x{b:02X}>".encode())
    if tid is None:
        tid = token_to_id.get(bytes([b]), LLAMA_TOKEN_NULL)
    return tid


def _recognize_special_texts(texts: list[bytes], by_text: dict[bytes, int], attrs: list[int],
                              special: SpecialTokens) -> frozenset[int]:
    """llama.cpp's load-time fixes by token text: EOT/EOM/FIM ids, UNUSED marks, the EOG set.
    by_text: the text -> id map of _read_tokens.

    A recognized token that is not a control token becomes one ("control-looking token").
    """

    def mark_control(tid: int) -> None:
        attrs[tid] |= _CONTROL

    for name, candidates in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
                             ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS),
                             ("fim_pad", _FIM_PAD_TEXTS), ("fim_rep", _FIM_REP_TEXTS),
                             ("fim_sep", _FIM_SEP_TEXTS)):
        if getattr(special, name) != LLAMA_TOKEN_NULL:
            continue
        ids = sorted(by_text[c.encode()] for c in candidates if c.encode() in by_text)
        if ids:
            setattr(special, name, ids[0])
            mark_control(ids[0])

    for i in np.flatnonzero(np.asarray(attrs) & _CONTROL).tolist():    # control tokens only
        if b"unused" in texts[i]:
            attrs[i] |= _UNUSED

    eog = {tid for tid in (special.fim_pad, special.fim_rep, special.fim_sep) if tid != LLAMA_TOKEN_NULL}
    for c in _EOG_TEXTS:
        tid = by_text.get(c.encode())
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for c in _ALWAYS_RENDERED_TEXTS:
        tid = by_text.get(c.encode())
        if tid is not None:
            attrs[tid] = _USER_DEFINED
    eog.update(tid for tid in (special.eos, special.eot, special.eom) if tid != LLAMA_TOKEN_NULL)

    eog_texts = {texts[tid]: tid for tid in eog}
    # gpt-oss / solar-open: "<|end|>" ends a message, not the generation.
    if b"<|end|>" in eog_texts and ((b"<|return|>" in eog_texts and b"<|call|>" in eog_texts)
                                    or (b"<|calls|>" in eog_texts and b"<|flush|>" in eog_texts)):
        end = eog_texts[b"<|end|>"]
        eog.discard(end)
        attrs[end] = _USER_DEFINED
    # gemma4 / paddleocr: "</s>" is an ordinary token there.
    if b"<|tool_response>" in eog_texts and b"</s>" in eog_texts:
        s = eog_texts[b"</s>"]
        eog.discard(s)
        attrs[s] = _NORMAL
    return frozenset(eog)


def _apply_model_attrs(ml: GGUFMeta, texts: list[bytes], attrs: list[int],
                       token_to_id: dict[bytes, int], pre: str) -> None:
    """Per-model LSTRIP/RSTRIP attributes llama.cpp sets by model, pre-tokenizer or arch name."""
    name = ml.get_key(LLMKV.GENERAL_NAME, str, "").lower()
    arch = ml.get_key(LLMKV.GENERAL_ARCHITECTURE, str, "")

    def set_attr(text: str, attr: int, value: bool) -> None:
        tid = token_to_id.get(text.encode())
        if tid is None:
            raise ml.error(f"model '{name}' needs the token '{text}', which is not in the vocabulary")
        attrs[tid] = attrs[tid] | attr if value else attrs[tid] & ~attr

    if (any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
            or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3"))):
        if b"<mask>" in token_to_id:
            set_attr("<mask>", _LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
        for i, a in enumerate(attrs):
            if a & _SPECIAL_ATTRS:
                attrs[i] = a | _RSTRIP
        set_attr("</s>", _RSTRIP, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            set_attr(text, _RSTRIP, False)
    elif "modern-bert" in name:
        if b"[MASK]" in token_to_id:
            set_attr("[MASK]", _LSTRIP, True)
