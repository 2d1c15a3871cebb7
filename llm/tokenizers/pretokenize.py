"""BPE pre-tokenizers: `tokenizer.ggml.pre` -> llama.cpp's regex list and load-time flags.

llama.cpp (`llm_tokenizer_bpe` and `llama_vocab::impl::load`) selects a list of regexes by the
pre-tokenizer name and applies them in turn: each regex splits every piece left by the
previous one into its matches and the gaps between them. The regexes are written in
ECMAScript syntax with Unicode classes (`\\p{L}`, `\\p{N}`, `\\p{P}`, `\\p{S}`, `\\p{M}`), which
C++ std::regex cannot evaluate, so llama.cpp rewrites them for its collapsed text (see
`unicode.py`): each `\\p{X}` becomes the class's stand-in character plus a fixed ASCII list.
We do the same rewrite and run the result with Python's `re` in ASCII mode, whose `\\s`,
`\\S` and `\\d` mean what they mean in C++ (ASCII only). Regexes without a Unicode class run
on the text itself with non-ASCII whitespace replaced by U+000B, as llama.cpp's wregex does.

llama.cpp has hand-written matchers for the GPT-2 and Llama-3 regexes; they behave as the
regexes do on the collapsed text (the GPT-2 one also matches the `\\s+` that the regex
string lacks, which we write out).

Only the pre-tokenizers in PRE_TOKENIZERS are supported; any other name is an error at load
time, never a silent fallback.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from llm.tokenizers.unicode import (
    COLLAPSED_ACCENT_MARK,
    COLLAPSED_LETTER,
    COLLAPSED_NUMBER,
    COLLAPSED_PUNCTUATION,
    COLLAPSED_SYMBOL,
    collapse,
    whitespace_to_vt,
)

# Unicode classes llama.cpp can rewrite, with the ASCII members it lists for each
# (k_ucat_map); the sub-classes of \p{L} all stand for "letter".
_UNICODE_CLASSES = {
    r"\p{N}": (COLLAPSED_NUMBER, "0-9"),
    r"\p{L}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{Lu}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{Ll}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{Lt}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{Lm}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{Lo}": (COLLAPSED_LETTER, "A-Za-z"),
    r"\p{P}": (COLLAPSED_PUNCTUATION, r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    r"\p{M}": (COLLAPSED_ACCENT_MARK, ""),
    r"\p{S}": (COLLAPSED_SYMBOL, r"\$\+<->^`\|"),
}
_UNICODE_CLASS = re.compile(r"\\p\{[A-Za-z]+\}")

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's with combining marks inside words and out of the punctuation runs
QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
          r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
# DeepSeek's approximation of cased letters (written with escapes: several of these code
# points have canonical equivalents that an editor could silently substitute).
_DEEPSEEK_LETTERS = (
    r"A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    r"\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    r"\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    r"\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    r"\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    r"\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    r"\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    r"\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    r"\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    r"\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_BLOOM = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (GPT2,),
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "starcoder": (r"\p{N}", GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
        r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+\Z",            # ECMAScript `$`: the end of the piece only
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!" '"' r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "gpt-4o": (GPT4O,),
    "tekken": (TEKKEN,),
    "seed-coder": (SEED_CODER,),
    "bailingmoe": (BAILINGMOE,),
    # SPM-style BPE: merges run over whole lines (spaces already escaped to U+2581)
    "gemma4": (r"[^\n]+|[\n]+",),
}


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What `tokenizer.ggml.pre` selects: a regex list and the flags llama.cpp sets with it."""

    regexes: str              # key of the regex list (llama.cpp's LLAMA_VOCAB_PRE_TYPE_*)
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    add_sep: bool = False
    no_bos: bool = False      # the BOS id defaults to none (ChatGLM)
    byte_encode: bool = True  # words as GPT-2 byte-level characters; False: raw UTF-8, <0xXX> byte tokens
    whole_newlines: bool = False  # a word of newlines that is a token stays whole (Gemma 4)


_SPECS: list[tuple[tuple[str, ...], PreTokenizerSpec]] = [
    (("default",), PreTokenizerSpec("default")),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), PreTokenizerSpec("llama3", ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizerSpec("llama3")),
    (("deepseek-llm",), PreTokenizerSpec("deepseek-llm", clean_spaces=False)),
    (("deepseek-coder",), PreTokenizerSpec("deepseek-coder", clean_spaces=False)),
    (("deepseek-v3",), PreTokenizerSpec("deepseek-v3", clean_spaces=False)),
    (("falcon",), PreTokenizerSpec("falcon")),
    (("mpt", "olmo", "jais", "exaone4", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat",
      "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"), PreTokenizerSpec("gpt2")),
    (("jina-v1-en", "jina-v2-code", "roberta-bpe"), PreTokenizerSpec("gpt2", add_sep=True)),
    (("trillion", "granite-docling"), PreTokenizerSpec("gpt2", clean_spaces=False)),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizerSpec("starcoder")),
    (("command-r", "smollm"), PreTokenizerSpec("starcoder", clean_spaces=False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"),
     PreTokenizerSpec("qwen2", clean_spaces=False)),
    (("qwen35",), PreTokenizerSpec("qwen35", clean_spaces=False)),
    (("stablelm2", "megrez"), PreTokenizerSpec("qwen2")),
    (("poro-chat",), PreTokenizerSpec("bloom", clean_spaces=False)),
    (("bloom", "gpt3-finnish"), PreTokenizerSpec("bloom")),
    (("glm4", "chatglm-bpe"), PreTokenizerSpec("llama3", no_bos=True)),
    (("viking",), PreTokenizerSpec("viking", clean_spaces=False)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
     PreTokenizerSpec("gpt-4o", clean_spaces=False)),
    (("tekken",), PreTokenizerSpec("tekken", clean_spaces=False, ignore_merges=True, add_bos=True)),
    (("seed-coder",), PreTokenizerSpec("seed-coder", clean_spaces=False)),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizerSpec("bailingmoe", clean_spaces=False)),
    (("gemma4",), PreTokenizerSpec("gemma4", add_bos=True, byte_encode=False, whole_newlines=True)),
]
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {name: spec for names, spec in _SPECS for name in names}


def collapse_regex(regex: str) -> str:
    """Rewrite the Unicode classes of a regex for the collapsed text, as llama.cpp does.

    Outside brackets `\\p{X}` becomes `[<stand-in><ascii members>]`; inside brackets the
    brackets are left out. Brackets escaped with a backslash do not count.
    """
    out = []
    inside = False
    i = 0
    while i < len(regex):
        c = regex[i]
        escaped = i > 0 and regex[i - 1] == "\\"
        if c == "[" and not escaped:
            inside = True
        elif c == "]" and inside and not escaped:
            inside = False
        elif c == "\\":
            m = _UNICODE_CLASS.match(regex, i)
            if m and m.group() in _UNICODE_CLASSES:
                stand_in, ascii_members = _UNICODE_CLASSES[m.group()]
                body = stand_in + ascii_members
                out.append(body if inside else f"[{body}]")
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Split:
    pattern: re.Pattern
    collapsed: bool           # matched against the collapsed text, else the wregex text


class PreTokenizer:
    """Splits text into the words that BPE merges within, exactly as llama.cpp does."""

    def __init__(self, name: str):
        self.name = name
        splits = []
        for regex in _REGEXES[name]:
            uses_classes = any(c in regex for c in _UNICODE_CLASSES)
            text = collapse_regex(regex) if uses_classes else regex
            splits.append(_Split(re.compile(text, re.ASCII), uses_classes))
        self.splits = tuple(splits)
        self.uses_collapsed = any(s.collapsed for s in splits)
        self.uses_wtext = not all(s.collapsed for s in splits)

    def split(self, text: str) -> list[str]:
        """The words of `text` (code points as llama.cpp decoded them), in order."""
        if not text:
            return []
        collapsed = collapse(text) if self.uses_collapsed else ""
        wtext = whitespace_to_vt(text) if self.uses_wtext else ""
        pieces = [(0, len(text))]
        for s in self.splits:
            view = collapsed if s.collapsed else wtext
            finditer = s.pattern.finditer
            out = []
            for start, end in pieces:
                pos = start
                for m in finditer(view, start, end):
                    a, b = m.span()
                    if a == b:
                        continue
                    if a > pos:
                        out.append((pos, a))
                    out.append((a, b))
                    pos = b
                if pos < end:
                    out.append((pos, end))
            pieces = out
        return [text[a:b] for a, b in pieces]


def pre_tokenizer(name: str) -> PreTokenizer:
    """The (cached) compiled pre-tokenizer for a regex-list name of PreTokenizerSpec."""
    p = _compiled.get(name)
    if p is None:
        p = _compiled[name] = PreTokenizer(name)
    return p


_compiled: dict[str, PreTokenizer] = {}
