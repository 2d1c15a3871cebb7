"""Tool-call grammars per chat format: the model writes its own markup, constrained to the tools.

As llama.cpp's common_chat_params_init_* build a GBNF grammar for each format, these build an
llguidance Lark grammar whose arguments are the tools' JSON schemas (`%json`). With tool_choice
"required" (or a named function) the reply must be a call from its first token; with "auto"
the grammar is lazy (llm.sampling.structured): free text until the format's opening marker
(its trigger), then the call, so a plain answer stays possible. Where a format reasons first,
the trigger is a pattern that waits until the reasoning is closed.

A marker that is one control token of the vocabulary (`[TOOL_CALLS]`, `<|python_tag|>`) is that
token in the grammar (`<[id]>`) and its trigger; other markers are text. A lazy grammar starts
at the token where its trigger starts; a lexeme that ends at the first marker ([lazy]) absorbs
what that token holds before it.
"""
from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass

from llm.chat.formats import THINK_TAGS, ChatFormat
from llm.generation.core import grammar_vocab
from llm.sampling import structured
from llm.sampling.structured import GrammarSpec, GrammarTrigger, TriggerKind
from llm.vocab import TokenAttr, Vocab

_CONTROL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def control_tokens(vocab: Vocab) -> dict[str, int]:
    """{text: id} of the vocabulary's control tokens (once per vocabulary)."""
    table = _CONTROL.get(vocab)
    if table is None:
        table = _CONTROL[vocab] = {vocab.texts[t].decode("utf-8", "replace"): t for t in range(vocab.n_tokens)
                                   if vocab.attrs[t] & TokenAttr.CONTROL and vocab.texts[t]}
    return table


@dataclass(frozen=True)
class ToolSpec:
    """One tool the reply may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes calls: `trigger` opens one, `body` (Lark) follows it; `head` is the
    part of the trigger a lazy grammar's first lexeme ends with (the rest begins the body);
    `sep` goes between parallel calls, each opened by the trigger again; `array`: the calls are
    one JSON array in the body (parallel is its maxItems); `at_start`: a lazy grammar waits for
    a call only at the start of the reply (`start_pattern` over the whole reply so far)."""

    trigger: str
    body: str
    head: str = ""
    sep: str = ""
    array: bool = False
    start_pattern: str = ""


class _Lark:
    """Lark text for one vocabulary: literals with its control tokens as <[id]>, JSON schemas."""

    def __init__(self, vocab: Vocab):
        self.control = control_tokens(vocab)
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.control, key=len, reverse=True))
                                + ")") if self.control else None

    def lit(self, text: str) -> str:
        parts = self.split.split(text) if self.split is not None else [text]
        out = [f"<[{self.control[p]}]>" if p in self.control else json.dumps(p, ensure_ascii=False)
               for p in parts if p]
        return " ".join(out) if out else '""'

    def is_token(self, text: str) -> bool:
        return text in self.control

    @staticmethod
    def json(schema: dict) -> str:
        return "%json " + json.dumps({**schema, "x-guidance": structured.JSON_OPTIONS}, ensure_ascii=False)


def _alts(parts: list[str]) -> str:
    return "(" + " | ".join(parts) + ")"


def _key(name: str) -> str:
    """The Lark literal of `"name": ` (JSON_OPTIONS' separators)."""
    return json.dumps(json.dumps(name) + ": ")


def _object(pairs: list[tuple[str, str]]) -> str:
    """A JSON object written in Lark, its keys in order and its values Lark: each tool's schema
    stays the root of its own `%json`, so its `$ref`s resolve."""
    return '"{" ' + ' ", " '.join(f"{_key(k)} {v}" for k, v in pairs) + ' "}"'


def _array(item: str, parallel: bool) -> str:
    return f'"[" {item} (", " {item})* "]"' if parallel else f'"[" {item} "]"'


def _const(name: str) -> str:
    return json.dumps(json.dumps(name))


def call_syntax(fmt: ChatFormat, tools: list[ToolSpec], *, parallel: bool, lark: _Lark) -> CallSyntax:
    """The markup of `fmt`'s calls to `tools` (the formats llama.cpp constrains)."""
    L, J = lark.lit, lark.json
    named = _alts([_object([("name", _const(t.name)), ("arguments", J(t.parameters))]) for t in tools])
    if fmt == ChatFormat.HERMES_2_PRO:
        return CallSyntax("<tool_call>", f'"\\n" {named} "\\n" {L("</tool_call>")}', sep='"\\n"')
    if fmt in (ChatFormat.LLAMA_3_X, ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS):
        alts = [f'{json.dumps(t.name)} "\\", \\"parameters\\": " {J(t.parameters)}' for t in tools]
        return CallSyntax('{"name": "', _alts(alts) + ' "}"', start_pattern=r'\s*(\{"name": ")[\s\S]*')
    if fmt == ChatFormat.MISTRAL_NEMO:
        item = _alts([_object([("name", _const(t.name)), ("arguments", J(t.parameters)),
                               ("id", '/"[a-zA-Z0-9]{9}"/')]) for t in tools])
        return CallSyntax("[TOOL_CALLS]", _array(item, parallel), array=True)
    if fmt == ChatFormat.FIREFUNCTION_V2:
        return CallSyntax(" functools[", _array(named, parallel), head=" functools", array=True)
    if fmt == ChatFormat.FUNCTIONARY_V3_2:
        alts = [f"{json.dumps(t.name + chr(10))} {J(t.parameters)}" for t in tools]
        names = "|".join(re.escape(t.name) for t in tools)
        return CallSyntax("", _alts(alts), sep='">>>"', start_pattern=f"(?:{names})\\n\\{{[\\s\\S]*")
    if fmt == ChatFormat.FUNCTIONARY_V3_1_LLAMA_3_1:
        alts = [f'{json.dumps(t.name + ">")} {J(t.parameters)}' for t in tools]
        return CallSyntax("<function=", _alts(alts) + ' "</function>"', sep='"\\n"')
    if fmt == ChatFormat.DEEPSEEK_R1:
        alts = [f'{L("function<｜tool▁sep｜>" + t.name + chr(10) + "```json" + chr(10))} {J(t.parameters)} '
                f'{L(chr(10) + "```<｜tool▁call▁end｜>")}' for t in tools]
        one = f'{L("<｜tool▁call▁begin｜>")} {_alts(alts)}'
        return CallSyntax("<｜tool▁calls▁begin｜>", f"{one}{' (' + one + ')*' if parallel else ''} "
                                                  f"{L('<｜tool▁calls▁end｜>')}", array=True)
    if fmt == ChatFormat.COMMAND_R7B:
        item = _alts([_object([("tool_call_id", '/"[0-9]{1,10}"/'), ("tool_name", _const(t.name)),
                               ("parameters", J(t.parameters))]) for t in tools])
        return CallSyntax("<|START_ACTION|>", f"{_array(item, parallel)} {L('<|END_ACTION|>')}", array=True)
    if fmt == ChatFormat.GRANITE:
        return CallSyntax("<|tool_call|>", _array(named, parallel), array=True)
    raise ValueError(f"no tool-call grammar for the {fmt.value} format")


def _reasoning_guard(fmt: ChatFormat, trigger: str, forced_open: bool) -> str:
    """A pattern for `trigger` once the reasoning is over: after its closing tag (when the prompt
    opened it), or anywhere when the reply does not open one, or after it is closed."""
    start, end = (re.escape(t) for t in THINK_TAGS[fmt])
    if forced_open:
        return f"{end}[\\s\\S]*?({re.escape(trigger)})"
    return f"^(?:\\s*{start}[\\s\\S]*?{end}|(?!\\s*{start}))[\\s\\S]*?({re.escape(trigger)})"


def tool_grammar(fmt: ChatFormat, tools: list[ToolSpec], *, required: bool, parallel: bool,
                 thinking_forced_open: bool, vocab: Vocab) -> GrammarSpec:
    """The grammar of a reply that calls `tools` in `fmt`: from its first token when `required`,
    else lazy (a call is optional)."""
    lark = _Lark(vocab)
    if fmt == ChatFormat.GPT_OSS:
        return _gpt_oss(tools, required=required, lark=lark, vocab=vocab)
    syn = call_syntax(fmt, tools, parallel=parallel, lark=lark)
    more = f" ({syn.sep} {lark.lit(syn.trigger)} {syn.body})*" if parallel and not syn.array else ""
    if not syn.trigger:     # Functionary v3.2: the calls follow one another, separated
        more = f" ({syn.sep} {syn.body})*" if parallel else ""
    if required:
        prefix = ""
        if thinking_forced_open and fmt in THINK_TAGS:
            prefix = f"({lark.lit(THINK_TAGS[fmt][1])} /[ \\t\\n]*/)? "
        opening = lark.lit(syn.head or syn.trigger) + " " if syn.trigger else ""
        return structured.spec_lark(f"start: {prefix}{opening}{syn.body}{more}\n", "tools", vocab=grammar_vocab(vocab))
    if syn.start_pattern:
        trigger = GrammarTrigger(TriggerKind.PATTERN_FULL, syn.start_pattern)
    elif fmt in THINK_TAGS:
        trigger = GrammarTrigger(TriggerKind.PATTERN, _reasoning_guard(fmt, syn.trigger, thinking_forced_open))
    elif lark.is_token(syn.trigger):
        trigger = GrammarTrigger(TriggerKind.TOKEN, syn.trigger, lark.control[syn.trigger])
    else:
        trigger = GrammarTrigger(TriggerKind.WORD, syn.trigger)
    rules = ""
    if not syn.trigger:
        start = syn.body
    elif lark.is_token(syn.trigger):
        start = f"{lark.lit(syn.trigger)} {syn.body}"
    else:
        start = f"hd {syn.body}"
        rules = f"hd[lazy]: /(.|\\n)*/ {json.dumps(syn.head or syn.trigger, ensure_ascii=False)}\n"
    return structured.spec_lark(f"start: {start}{more}\n{rules}", "tools", triggers=(trigger,),
                                vocab=grammar_vocab(vocab))


def _gpt_oss(tools: list[ToolSpec], *, required: bool, lark: _Lark, vocab: Vocab) -> GrammarSpec:
    """Harmony: ` to=functions.NAME<|channel|>commentary json<|message|>{...}` (recipient in the
    role) or `<|channel|>commentary to=functions.NAME json<|message|>{...}` (in the channel)."""
    L = lark.lit
    channel = f'{L("<|channel|>")} ("commentary" | "analysis")'
    constrain = f'(" " {L("<|constrain|>")}? "json")?'
    in_role = _alts([f'{json.dumps(t.name)} {channel} {constrain} {L("<|message|>")} {lark.json(t.parameters)}'
                     for t in tools])
    in_channel = _alts([f'{json.dumps(t.name)} {constrain} {L("<|message|>")} {lark.json(t.parameters)}'
                        for t in tools])
    call = f'(({L("<|start|>assistant")})? " to=functions." {in_role} | {channel} " to=functions." {in_channel})'
    if required:
        analysis = f'{L("<|channel|>analysis<|message|>")} /(.|\\n)*/ {L("<|end|>")} {L("<|start|>assistant")}'
        return structured.spec_lark(f"start: ({analysis})? {call}\n", "tools", vocab=grammar_vocab(vocab))
    triggers = (GrammarTrigger(TriggerKind.PATTERN, r"<\|channel\|>(?:commentary|analysis) to"),
                GrammarTrigger(TriggerKind.PATTERN, r"<\|start\|>assistant to"),
                GrammarTrigger(TriggerKind.PATTERN_FULL, r"\s*to[\s\S]*"))
    return structured.spec_lark(f"start: {call}\n", "tools", triggers=triggers, vocab=grammar_vocab(vocab))
