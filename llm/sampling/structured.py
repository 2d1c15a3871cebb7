"""Grammar-constrained sampling: GBNF grammars and JSON schemas, on llguidance.

llama.cpp puts its grammar sampler first in the chain: it sets the logit of every token
the grammar cannot accept next to -inf, and `accept` advances the grammar by the chosen
token. This module does the same with llguidance's matcher, which needs the vocabulary as
the bytes each token generates (`token_bytes`, checked to round-trip against the GGUF
texts by `check_token_bytes`).

Why llguidance (benchmarks/bench_grammar.py has the numbers): on both real vocabularies
its per-token mask is well under the 1 ms budget, it has no dependencies (xgrammar pulls in
torch, triton and transformers, ~2 GB, and takes ~10 s to import), and llama.cpp itself
offers it as its alternative grammar engine.

GBNF (llama.cpp's dialect) is parsed and checked by llm.gbnf and handed to llguidance in its
Lark dialect.

A lazy grammar (llama.cpp's `grammar_lazy` with `grammar_triggers`) leaves the output free until
one of its triggers appears (a word, a token, a regex anywhere or over the whole output), then
constrains it from the token where the trigger starts: a tool call that the model may or may not
make. The tokens since that one are replayed into the matcher, so the grammar begins with a lazy
lexeme that absorbs whatever that first token holds before the trigger.
"""
from __future__ import annotations

import bisect
import contextlib
import enum
import functools
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from llm.errors import GrammarError
from llm.sampling import gbnf as gbnf_mod
from llm.sampling.samplers import Sampler, TokenDataArray
from llm.tokenizers.spm import ESCAPED_SPACE
from llm.tokenizers.unicode import BYTE_TO_CHAR
from llm.vocab import TokenAttr, Vocab, VocabType

log = logging.getLogger(__name__)

# llguidance marks a special (control) token by a leading 0xff byte: text can never produce it
_SPECIAL_PREFIX = b"\xff"
# the parser's resource limits: a grammar past them fails to build instead of exhausting memory
LIMITS: dict[str, Any] = dict(max_grammar_size=500_000, max_lexer_states=250_000, step_max_items=50_000,
                              initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_items_in_row=2000)
# a grammar text larger than this is refused before it is parsed
MAX_GRAMMAR_BYTES = 4 << 20
# a JSON schema whose objects and arrays nest deeper than this is refused before it is checked
# (the schema checks recurse: a 3000-level schema overflowed Python's stack)
MAX_SCHEMA_DEPTH = 64
_TOO_DEEP = f"json_schema: objects and arrays nested more than {MAX_SCHEMA_DEPTH} levels deep"
# JSON output on one line with ", " and ": " between items: small models otherwise drift
# into long runs of whitespace, which the schema allows but which eat max_tokens
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# --- the vocabulary as bytes --------------------------------------------------------------


def token_bytes(vocab: Vocab) -> list[bytes]:
    """The bytes each token adds to the generated text, as llguidance wants them.

    Normal tokens decode their SPM (U+2581 for space) or byte-level (GPT-2 characters)
    text; byte tokens <0xXX> give their byte; user-defined tokens their text. Control and
    unknown tokens get 0xff + text (llguidance's mark of a special token, which no grammar
    text can match); unused tokens, b"" (never allowed).
    """
    out = []
    for t in range(vocab.n_tokens):
        attr = vocab.attrs[t]
        if attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
            out.append(_SPECIAL_PREFIX + vocab.texts[t])
        elif attr & TokenAttr.UNUSED:
            out.append(b"")
        else:
            out.append(vocab.token_to_piece(t, special=True))
    return out


def _encode_text(vocab: Vocab, attr: int, piece: bytes) -> bytes:
    """The inverse of the piece rendering: the GGUF text a token with these bytes has."""
    if attr & TokenAttr.BYTE:
        return b"<0x%02X>" % piece[0] if len(piece) == 1 else b""
    if attr & TokenAttr.NORMAL:
        if vocab.flags.escape_whitespaces:
            return piece.replace(b" ", ESCAPED_SPACE)
        return "".join(BYTE_TO_CHAR[b] for b in piece).encode("utf-8")
    return piece


def check_token_bytes(vocab: Vocab, pieces: Sequence[bytes]) -> list[int]:
    """Check that every token's bytes map back to its GGUF text; return the tokens that do not.

    Byte-level BPE round-trips exactly; an SPM normal token whose text holds a literal
    space (or a BPE text with a character outside GPT-2's byte map) cannot, and is listed.
    """
    if len(pieces) != vocab.n_tokens:
        raise GrammarError(f"token bytes: {len(pieces)} entries for a vocabulary of {vocab.n_tokens}")
    bad = []
    for t, piece in enumerate(pieces):
        attr = vocab.attrs[t]
        if attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
            ok = piece == _SPECIAL_PREFIX + vocab.texts[t]
        elif attr & TokenAttr.UNUSED:
            ok = piece == b""
        else:
            ok = _encode_text(vocab, attr, piece) == vocab.texts[t]
        if not ok:
            bad.append(t)
    return bad


class GrammarVocab:
    """llguidance's tokenizer for one vocabulary: token bytes, EOG tokens, a tokenize function.

    Building it costs about a second for 262144 tokens; LLM keeps one per model.
    """

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.pieces = token_bytes(vocab)
        bad = check_token_bytes(vocab, self.pieces)
        if bad:
            # a token whose bytes are not what its text says would let text slip past the grammar
            log.warning("%s: %d tokens do not round-trip to their bytes (first: %d); grammars never allow them",
                        vocab.path, len(bad), bad[0])
            for t in bad:
                self.pieces[t] = b""
        self.n_unusable = len(bad)
        self.eog = sorted(vocab.eog_ids)
        eos = self.eog if self.eog else [vocab.eos]
        wrapper = llguidance.TokenizerWrapper(_TokenizerShim(vocab, self.pieces, eos[0]))
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab.n_tokens, eos_token=eos)


@dataclass
class _TokenizerShim:
    """What llguidance's TokenizerWrapper reads: tokens, eos/bos ids, and bytes -> ids."""

    vocab: Vocab
    tokens: list[bytes]
    eos_token_id: int

    @property
    def bos_token_id(self) -> int | None:
        return self.vocab.bos if self.vocab.bos >= 0 else None

    @property
    def special_token_ids(self) -> list[int]:
        return [t for t, p in enumerate(self.tokens) if p.startswith(_SPECIAL_PREFIX)]

    def __call__(self, text: bytes) -> list[int]:
        """Tokens whose bytes are exactly `text` (llguidance re-tokenizes forced text with it):
        an SPM vocabulary's space prefix is not added."""
        if self.vocab.type == VocabType.SPM:
            return self.vocab.tokenizer.tokenize(text.replace(b" ", ESCAPED_SPACE))
        return self.vocab.tokenize(text, add_special=False, parse_special=False)


# --- grammar sources -> llguidance grammars -----------------------------------------------


def gbnf_to_lark(gbnf: str, root: str = "root") -> str:
    """llama.cpp's GBNF -> llguidance's Lark dialect (llm.gbnf); GrammarError names what is wrong."""
    if not isinstance(gbnf, str):
        raise GrammarError(f"grammar: expected GBNF text (str), got {type(gbnf).__name__}")
    if len(gbnf.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"grammar: {len(gbnf)} characters is more than the {MAX_GRAMMAR_BYTES} bytes allowed")
    return gbnf_mod.to_lark(gbnf, root)


@contextlib.contextmanager
def _no_recursion_error(what: str) -> Iterator[None]:
    """A RecursionError while a grammar is converted or checked is a GrammarError (a 400 for a
    server), not a crash: the depth bounds should keep it from happening at all."""
    try:
        yield
    except RecursionError:
        raise GrammarError(f"{what}: nested too deeply to convert") from None


def schema_depth(schema: object) -> int:
    """How deep the objects and arrays of a (parsed) JSON schema nest; an explicit stack, no
    recursion, since the schema may be anything."""
    deepest = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[object]
        if isinstance(node, Mapping):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def _checked(grammar: str, what: str) -> str:
    """Validate an llguidance grammar (without a vocabulary) so errors come before decoding."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
    if is_error:
        raise GrammarError(f"{what}: {messages[0] if messages else 'invalid'}")
    return grammar


def check_schema(schema) -> dict | bool:
    """A JSON schema (a dict or its JSON text) checked against its metaschema; GrammarError names
    where it is wrong."""
    import jsonschema  # only needed for schemas

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema: not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError(_TOO_DEEP) from None
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise GrammarError(f"json_schema: expected a JSON object (dict), got {type(schema).__name__}")
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(_TOO_DEEP)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise GrammarError(f"json_schema: invalid schema at {'/'.join(map(str, e.absolute_path)) or '(root)'}: "
                           f"{e.message}") from None
    return dict(schema) if isinstance(schema, Mapping) else schema


class TriggerKind(enum.Enum):
    """llama.cpp's common_grammar_trigger_type."""

    WORD = "word"                  # this text anywhere in the output
    TOKEN = "token"                # this token
    PATTERN = "pattern"            # this regex anywhere (its first group, if any, is where the grammar starts)
    PATTERN_FULL = "pattern_full"  # this regex over the whole output so far


@dataclass(frozen=True)
class GrammarTrigger:
    kind: TriggerKind
    value: str = ""                # the word or the regex
    token: int = -1                # for TOKEN

    @functools.cached_property
    def regex(self) -> re.Pattern[bytes]:
        return re.compile(self.value.encode("utf-8"))


@dataclass(frozen=True)
class GrammarSpec:
    """A checked llguidance grammar, not yet bound to a vocabulary (unless it names token ids);
    with triggers, a lazy one."""

    grammar: str
    what: str
    triggers: tuple[GrammarTrigger, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)

    def sampler(self, vocab: GrammarVocab | Vocab) -> Grammar:
        """A Grammar sampler for this vocabulary (pass a GrammarVocab to reuse one: building it
        from a Vocab takes about a second for 262144 tokens)."""
        return Grammar(self, vocab if isinstance(vocab, GrammarVocab) else GrammarVocab(vocab))


def spec_gbnf(gbnf: str, root: str = "root") -> GrammarSpec:
    with _no_recursion_error("grammar"):
        lark = gbnf_to_lark(gbnf, root)
        return GrammarSpec(_checked(llguidance.LLMatcher.grammar_from_lark(lark), "grammar"), "grammar")


def spec_lark(lark: str, what: str, *, triggers: tuple[GrammarTrigger, ...] = (),
              vocab: GrammarVocab | None = None) -> GrammarSpec:
    """An llguidance Lark grammar (checked against `vocab` when it names tokens as <[id]>)."""
    if len(lark.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what}: {len(lark)} characters is more than the {MAX_GRAMMAR_BYTES} bytes allowed")
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None if vocab is None else vocab.tokenizer, limits=_limits())
    if is_error:
        raise GrammarError(f"{what}: {messages[0] if messages else 'invalid'}")
    return GrammarSpec(grammar, what, triggers)


def spec_json_schema(schema) -> GrammarSpec:
    """A JSON schema (a dict, or its JSON text) as a grammar; GrammarError names what is wrong,
    including a schema nested more than MAX_SCHEMA_DEPTH levels deep."""
    with _no_recursion_error("json_schema"):
        schema = check_schema(schema)
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema: cannot serialize: {e}") from None
        if len(text) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"json_schema: {len(text)} bytes is more than the {MAX_GRAMMAR_BYTES} allowed")
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"json_schema: {e}") from None
        return GrammarSpec(_checked(g, "json_schema"), "json_schema")


def spec_json_object() -> GrammarSpec:
    """JSON-object mode (OpenAI's response_format {"type": "json_object"}): any JSON object."""
    return spec_json_schema({"type": "object"})


def spec_response_format(response_format) -> GrammarSpec | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}. GrammarError names
    the field at fault; for a server, a 400."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")       # llama-server also takes a schema here
        return spec_json_schema(schema) if schema is not None else spec_json_object()
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise GrammarError("response_format.json_schema: expected an object with a 'schema' field")
        return spec_json_schema(js["schema"])
    raise GrammarError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")


# --- the sampler ----------------------------------------------------------------------------


def unpack_bitmask(bitmask: np.ndarray, n_vocab: int) -> np.ndarray:
    """llguidance's int32 bitmask (bit i of word i // 32 = token i allowed) -> bool [n_vocab]."""
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)


class Grammar(Sampler):
    """llama_sampler_init_grammar: -inf for every token the grammar cannot take next.

    Put it first in the chain (as llama.cpp does): the samplers after it then only see
    allowed tokens. Once the grammar is complete only end-of-generation tokens are allowed,
    so generation ends there; a grammar that cannot finish within max_tokens ends by length.
    A lazy grammar allows everything until a trigger (llama_sampler_init_grammar_lazy_patterns).
    """

    name = "grammar"

    def __init__(self, spec: GrammarSpec, gvocab: GrammarVocab):
        self.spec = spec
        self.gvocab = gvocab
        self.n_vocab = gvocab.vocab.n_tokens
        self.matcher = llguidance.LLMatcher(gvocab.tokenizer, spec.grammar, log_level=0, limits=_limits())
        self._raise_if_error()
        self.bitmask = np.zeros((self.n_vocab + 31) // 32, np.int32)
        self.awaiting = spec.lazy       # no trigger seen yet: nothing is constrained
        self.free = False               # a lazy grammar that could not follow its trigger constrains nothing
        self.seen = bytearray()         # the output while awaiting, and where each of its tokens starts
        self.starts: list[int] = []
        self.tokens: list[int] = []

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.spec.what}: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """The tokens the grammar accepts next, as a bool mask over the vocabulary."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        self._raise_if_error()
        return unpack_bitmask(self.bitmask, self.n_vocab)

    def apply(self, cur: TokenDataArray) -> None:
        if self.awaiting or self.free:
            return
        allowed = self.allowed()
        if cur.size == self.n_vocab and cur.ids[-1] == self.n_vocab - 1 and not cur.sorted:
            # first in the chain (ids 0..n-1): a grammar usually allows few tokens, so keep
            # those and fill the rest, rather than index by the large disallowed set
            keep = np.flatnonzero(allowed)
            kept = cur.logits[keep]
            cur.logits.fill(-np.inf)
            cur.logits[keep] = kept
        else:
            cur.logits[~allowed[cur.ids]] = -np.inf

    def accept(self, token: int) -> None:
        if self.free:
            return
        if self.awaiting:
            first = self._triggered(int(token))
            if first is None:
                return
            replay, self.awaiting = self.tokens[first:], False
            self.seen, self.starts, self.tokens = bytearray(), [], []
            if not self.matcher.consume_tokens(replay):
                # the text around the trigger is not what the grammar expects (llama.cpp fails the
                # request here); the reply stays unconstrained and its parser reads what it can
                log.warning("%s: the output after the trigger does not fit the grammar (%s); not constraining",
                            self.spec.what, self.matcher.get_error())
                self.free = True
            return
        if self.matcher.is_stopped() and token in self.gvocab.vocab.eog_ids:
            return
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"{self.spec.what}: token {token} is not allowed here: {self.matcher.get_error()}")

    def _triggered(self, token: int) -> int | None:
        """Record an output token while awaiting; the index (in self.tokens) of the token where
        the grammar starts, once a trigger has appeared."""
        self.starts.append(len(self.seen))
        self.tokens.append(token)
        self.seen += self.gvocab.vocab.token_to_piece(token, special=True)
        for trig in self.spec.triggers:
            if trig.kind == TriggerKind.TOKEN:
                at = self.starts[-1] if token == trig.token else -1
            elif trig.kind == TriggerKind.WORD:
                word = trig.value.encode("utf-8")
                at = self.seen.find(word, max(0, self.starts[-1] - len(word) + 1))
            else:
                find = trig.regex.search if trig.kind == TriggerKind.PATTERN else trig.regex.fullmatch
                m = find(self.seen)
                at = -1 if m is None else m.start(1) if trig.regex.groups else m.start()
            if at >= 0:
                return bisect.bisect_right(self.starts, at) - 1
        return None

    def is_accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (or, for a lazy
        grammar, no trigger has come yet)."""
        return self.awaiting or self.free or self.matcher.is_accepting()

    def reset(self) -> None:
        self.matcher.reset()
        self.awaiting, self.free = self.spec.lazy, False
        self.seen, self.starts, self.tokens = bytearray(), [], []

    def clone(self) -> Grammar:
        twin = object.__new__(Grammar)
        twin.spec, twin.gvocab, twin.n_vocab = self.spec, self.gvocab, self.n_vocab
        twin.matcher = self.matcher.deep_copy()
        twin.bitmask = self.bitmask.copy()
        twin.awaiting, twin.free = self.awaiting, self.free
        twin.seen, twin.starts, twin.tokens = bytearray(self.seen), list(self.starts), list(self.tokens)
        return twin
