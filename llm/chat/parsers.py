"""Reading a reply back: its text -> content, reasoning_content and tool calls, per chat format.

One parser per format (llama.cpp's common_chat_parse_*), over the whole text so far. While the
reply is still arriving (`partial`), text that may yet become markup (`<tool_c`, `<thi`, a cut
JSON object) is held back from content, and a tool call whose name is complete is returned with
the arguments written so far. A finished reply whose markup does not parse is read as content
(with its reasoning), as llama.cpp does.

`ChatStream` is the one state of a reply for both uses: fed as text arrives, it gives the
difference to what it returned before (OpenAI's deltas: content, reasoning_content, and each
tool call's id and name once, then fragments of its arguments); finished, it gives the whole
message, the tool calls keeping the ids their deltas had.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from llm.chat import partial_json as pj
from llm.chat.formats import THINK_TAGS, ChatFormat, ChatSyntax
from llm.chat.partial_json import Incomplete

log = logging.getLogger(__name__)

# how far back from the end of a partial reply a `holds` pattern (markup that may be cut) is looked for
HOLD_WINDOW = 128


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text (while streaming: what has been written of it)
    id: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChatMsg:
    """An assistant reply, read (llama.cpp's common_chat_msg)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class _Reader:
    """One parse: the text, a position in it, and the message read so far."""

    def __init__(self, text: str, syntax: ChatSyntax, partial: bool):
        self.text, self.syntax, self.partial = text, syntax, partial
        self.pos = 0
        self.msg = ChatMsg()

    # ---- content and markup ------------------------------------------------------------

    def content_to(self, end: int) -> None:
        self.msg.content += self.text[self.pos:end]
        self.pos = max(self.pos, end)

    def rest_is_content(self) -> None:
        self.content_to(len(self.text))

    def find(self, rx: re.Pattern[str], markers: Iterable[str] = (), holds: Iterable[re.Pattern[str]] = ()
             ) -> re.Match[str] | None:
        """The next match of rx, the text before it added to content and the position after it.
        None when there is none; while partial, the text up to where one of `markers` (or a
        `holds` regex that runs to the end) may still begin is added, and the rest is held
        back (Incomplete)."""
        m = rx.search(self.text, self.pos)
        if m is not None:
            self.content_to(m.start())
            self.pos = m.end()
            return m
        if self.partial:
            tail = max(self.pos, len(self.text) - HOLD_WINDOW)
            cut = min([partial_start(self.text, mark, self.pos) for mark in markers]
                      + [h.start() for h in (rx_.search(self.text, tail) for rx_ in holds) if h is not None]
                      + [len(self.text)])
            if cut < len(self.text):
                self.content_to(cut)
                raise Incomplete
        return None

    def literal(self, lit: str) -> re.Match[str] | None:
        """find() for a literal marker."""
        return self.find(re.compile(re.escape(lit)), (lit,))

    def close(self, lit: str) -> None:
        """Consume `lit` and the whitespace around it when it is there (Incomplete while the text
        may still become it); a missing closing tag at the end of a reply is forgiven."""
        i = pj.skip_ws(self.text, self.pos)
        if self.text.startswith(lit, i):
            self.pos = pj.skip_ws(self.text, i + len(lit))
        elif self.partial and lit.startswith(self.text[i:]):
            raise Incomplete
        else:
            self.pos = i if i == len(self.text) else self.pos

    def reasoning(self, start: str, end: str) -> None:
        """The reasoning block at the start of the reply (or the reply's beginning, when the prompt
        opened the block), stripped, into reasoning_content (llama.cpp's try_parse_reasoning)."""
        if not self.syntax.reasoning:
            return
        text = self.text
        i = self.pos
        while i < len(text) and text[i].isspace():
            i += 1
        if text.startswith(start, i):
            begin = i + len(start)
        elif self.partial and start.startswith(text[i:]) and (i < len(text) or not self.syntax.thinking_forced_open):
            self.pos = len(text)
            raise Incomplete        # whitespace, or the opening tag cut
        elif self.syntax.thinking_forced_open:
            begin = i
        else:
            return
        k = text.find(end, begin)
        if k < 0:
            cut = partial_start(text, end, begin) if self.partial else len(text)
            self.msg.reasoning_content += text[begin:cut].strip()
            self.pos = len(text)
            return
        self.msg.reasoning_content += text[begin:k].strip()
        self.pos = pj.skip_ws(text, k + len(end))

    # ---- tool calls ---------------------------------------------------------------------

    def add_call(self, name: str, arguments: str) -> None:
        self.msg.tool_calls.append(ToolCall(name, arguments or ("" if self.partial else "{}")))

    def arguments(self, span: tuple[int, int | None] | None) -> str:
        """The text of the arguments value: raw JSON as written (an object so far, while cut); a
        JSON string holding the arguments is decoded once complete."""
        if span is None:
            return ""
        start, end = span
        if self.text.startswith('"', start):
            return "" if end is None else json.loads(self.text[start:end])
        return self.text[start:] if end is None else self.text[start:end]

    def call_object(self, start: int, name_key: str = "name", args_key: str = "arguments") -> int:
        """Add the call written as the JSON object at text[start] ({name, arguments}); the index
        after it. While cut: the call once its name is complete, then Incomplete."""
        fields, end = pj.members(self.text, start)
        name_span = fields.get(name_key)
        name = None
        if name_span is not None and name_span[1] is not None:
            name = json.loads(self.text[name_span[0]:name_span[1]])
        if end is None:
            if isinstance(name, str) and name:
                self.add_call(name, self.arguments(fields.get(args_key)))
            raise Incomplete
        json.loads(self.text[start:end])
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool call without a {name_key!r}")
        self.add_call(name, self.arguments(fields.get(args_key)))
        return end

    def call_array(self, start: int, name_key: str = "name", args_key: str = "arguments") -> int:
        """Add each call of the JSON array at text[start]; the index after it."""
        items, end = pj.elements(self.text, start)
        for item_start, _ in items:
            self.call_object(item_start, name_key, args_key)
        if end is None:
            raise Incomplete
        return end

    def call_with_args(self, name: str) -> None:
        """A call whose arguments are the JSON value at the position (after whitespace)."""
        start = pj.skip_ws(self.text, self.pos)
        try:
            end = pj.value_end(self.text, start)
        except Incomplete:
            self.add_call(name, self.text[start:])
            raise
        self.add_call(name, self.text[start:end])
        self.pos = end

    def code_call(self, name: str) -> None:
        """The rest of the reply as raw code: arguments {"code": ...} (what is written so far)."""
        code = json.dumps(self.text[self.pos:])
        self.add_call(name, '{"code": ' + (code[:-1] if self.partial else code + "}"))
        self.pos = len(self.text)


def partial_start(text: str, marker: str, pos: int = 0) -> int:
    """Where the longest end of `text` (from pos) that begins `marker` but is shorter starts;
    len(text) when none does."""
    for n in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


# ---- one parser per format ---------------------------------------------------------------

def _content_only(r: _Reader) -> None:
    r.reasoning(*THINK_TAGS[ChatFormat.CONTENT_ONLY])
    r.rest_is_content()


def _generic(r: _Reader) -> None:
    """{"tool_call": {...}} / {"tool_calls": [...]} / {"response": ...} (llm.chat.tool_calls)."""
    r.reasoning(*THINK_TAGS[ChatFormat.GENERIC])
    i = pj.skip_ws(r.text, r.pos)
    fields, end = pj.members(r.text, i)
    if "tool_calls" in fields:
        r.call_array(fields["tool_calls"][0])
    elif "tool_call" in fields:
        r.call_object(fields["tool_call"][0])
    elif "response" in fields:
        start, stop = fields["response"]
        if stop is None:
            if r.text.startswith('"', start):
                r.msg.content += pj.string_prefix(r.text[start:])
            raise Incomplete
        value = json.loads(r.text[start:stop])
        r.msg.content += value if isinstance(value, str) else json.dumps(value, indent=2)
    elif end is not None:
        raise ValueError("expected 'tool_call', 'tool_calls' or 'response'")
    if end is None:
        raise Incomplete
    r.pos = end


_HERMES_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")
_HERMES_OPEN = re.compile(r'(?=[`<{\s])(?:(```(?:xml|json)?\n\s*)?(<(?:' + "|".join(_HERMES_TAGS) + r')>)?'
                          r'(\s*\{\s*"name")|<function=([^>]+)>|<function name="([^"]+)">)')
_HERMES_TAG = r'(?:```(?:xml|json)?\n\s*)?<(?:' + "|".join(_HERMES_TAGS) + r')>'
_HERMES_HOLDS = (       # what a call may still become (an opening tag, then `{"name"`), at the end of the text
    re.compile(r'(?:' + _HERMES_TAG + r')?\s*\{\s*(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?$'),
    re.compile(_HERMES_TAG + r'\s*$'),
    re.compile(r"`{1,3}[a-z]{0,4}\n?\s*$"),
    re.compile(r'<function(?:=[^>]*|\s+name="[^"]*"?)$'),
)
_HERMES_MARKERS = tuple(f"<{t}>" for t in _HERMES_TAGS) + ("<function=", '<function name="')


def _hermes(r: _Reader) -> None:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (and the variants llama.cpp
    forgives: other tags, a ``` block, a bare object, <function=name>{...}</function>)."""
    r.reasoning(*THINK_TAGS[ChatFormat.HERMES_2_PRO])
    if not r.syntax.parse_tool_calls:
        return r.rest_is_content()
    while (m := r.find(_HERMES_OPEN, _HERMES_MARKERS, _HERMES_HOLDS)) is not None:
        fence = m.group(1)
        if m.group(3):
            r.pos = r.call_object(r.text.index("{", m.start(3)))
            if m.group(2):
                r.close("</" + m.group(2)[1:])
        else:
            r.call_with_args(m.group(4) or m.group(5))
            r.close("</function>")
        if fence:
            r.close("```")
    r.rest_is_content()


_LLAMA_CALL = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([^"]+)"\s*,\s*"parameters"\s*:\s*')
_PYTHON_TAG = "<|python_tag|>"


def _llama_3_x(r: _Reader) -> None:
    """{"name": ..., "parameters": {...}} as the whole reply (llama.cpp reads it at the start only),
    or, with builtin tools, <|python_tag|>name.call(key=value, ...)."""
    if not r.syntax.parse_tool_calls:
        return r.rest_is_content()
    if r.syntax.format == ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS and r.literal(_PYTHON_TAG) is not None:
        return _builtin_call(r)
    i = pj.skip_ws(r.text, 0)
    m = _LLAMA_CALL.match(r.text, i)
    if m is not None:
        r.pos = m.end()
        r.call_with_args(m.group(1))
        r.close("}")
    elif r.text.startswith("{", i) and r.partial:
        pj.value_end(r.text, i)     # a cut object may still become a call: Incomplete holds it
    r.rest_is_content()


def _builtin_call(r: _Reader) -> None:
    head = re.compile(r"\s*(\w+)\s*\.\s*call\(").match(r.text, r.pos)
    if head is None:
        raise Incomplete if r.partial else ValueError("expected name.call(...) after <|python_tag|>")
    args, j = {}, head.end()
    while (arg := re.compile(r"\s*(\w+)\s*=\s*").match(r.text, j)) is not None:
        end = pj.value_end(r.text, arg.end())
        args[arg.group(1)] = json.loads(r.text[arg.end():end])
        j = pj.skip_ws(r.text, end)
        if not r.text.startswith(",", j):
            break
        j += 1
    j = pj.skip_ws(r.text, j)
    if j >= len(r.text):
        raise Incomplete
    if r.text[j] != ")":
        raise ValueError("expected ')' to close a builtin tool call")
    r.add_call(head.group(1), json.dumps(args))
    r.pos = j + 1
    r.rest_is_content()


_DS_BEGINS = ("<｜tool▁calls▁begin｜>", "<｜tool_calls_begin｜>", "<｜tool calls begin｜>",
              "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>")
_DS_BEGIN = re.compile("|".join(map(re.escape, _DS_BEGINS)))
_DS_CALL = re.compile("\\s*(?:<｜tool▁call▁begin｜>)?function<｜tool▁sep｜>([^\n]+)\n```json\n")
_DS_CALL_END = re.compile("\\s*```[\\s\\r\\n]*<｜tool▁call▁end｜>")
_DS_END = "<｜tool▁calls▁end｜>"


def _deepseek_r1(r: _Reader) -> None:
    """<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}```
    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>, after the reasoning."""
    r.reasoning(*THINK_TAGS[ChatFormat.DEEPSEEK_R1])
    if not r.syntax.parse_tool_calls or r.find(_DS_BEGIN, _DS_BEGINS) is None:
        return r.rest_is_content()
    while (m := _DS_CALL.match(r.text, r.pos)) is not None:
        r.pos = m.end()
        r.call_with_args(m.group(1).strip())
        end = _DS_CALL_END.match(r.text, r.pos)
        if end is None:
            if r.partial:
                raise Incomplete
            break
        r.pos = end.end()
    if r.partial and not r.text.startswith(_DS_END, pj.skip_ws(r.text, r.pos)):
        raise Incomplete        # inside the block of calls: nothing is content
    r.close(_DS_END)
    r.rest_is_content()


def _mistral_nemo(r: _Reader) -> None:
    """[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]"""
    if not r.syntax.parse_tool_calls or r.literal("[TOOL_CALLS]") is None:
        return r.rest_is_content()
    r.pos = r.call_array(pj.skip_ws(r.text, r.pos))
    r.rest_is_content()


def _firefunction_v2(r: _Reader) -> None:
    """ functools[{"name": ..., "arguments": {...}}, ...]"""
    if not r.syntax.parse_tool_calls or r.literal(" functools[") is None:
        return r.rest_is_content()
    r.pos = r.call_array(r.pos - 1)
    r.rest_is_content()


_FN32_FIRST = re.compile(r"(\w+)\n(?=\{)|(python|all)\n")
_FN32_NEXT = re.compile(r">>>(?:(\w+)\n(?=\{)|(python|all)\n)")


def _functionary_v3_2(r: _Reader) -> None:
    """NAME\\n{...}>>>NAME\\n{...}; `all\\n` opens plain content; python may be raw code."""
    m = _FN32_FIRST.match(r.text)
    if m is None and r.partial and re.fullmatch(r"\w*\n?", r.text):
        raise Incomplete
    while m is not None:
        r.pos = m.end()
        name = m.group(1) or m.group(2)
        if name == "python" and not r.text.startswith("{", r.pos):
            return r.code_call("python")
        if name != "all":
            r.call_with_args(name)
            r.pos = pj.skip_ws(r.text, r.pos)
        m = r.find(_FN32_NEXT, (">>>",), (re.compile(r">>>\w*\n?$"),))
    r.rest_is_content()


_FN31_CALL = re.compile(r"<function=(\w+)>|<\|python_tag\|>")


def _functionary_v3_1(r: _Reader) -> None:
    """<function=NAME>{...}</function>, and <|python_tag|> raw code."""
    if not r.syntax.parse_tool_calls:
        return r.rest_is_content()
    while (m := r.find(_FN31_CALL, ("<function=", _PYTHON_TAG), (re.compile(r"<function=\w*$"),))) is not None:
        if m.group(1) is None:
            return r.code_call("python")
        r.call_with_args(m.group(1))
        r.close("</function>")
    r.rest_is_content()


_R7B_OPEN = re.compile(r"<\|START_ACTION\|>|<\|START_RESPONSE\|>")


def _command_r7b(r: _Reader) -> None:
    """<|START_THINKING|>...<|END_THINKING|>, then <|START_ACTION|>[{"tool_call_id", "tool_name",
    "parameters"}]<|END_ACTION|> or <|START_RESPONSE|>...<|END_RESPONSE|>."""
    r.reasoning(*THINK_TAGS[ChatFormat.COMMAND_R7B])
    m = r.find(_R7B_OPEN, ("<|START_ACTION|>", "<|START_RESPONSE|>"))
    if m is None:
        return r.rest_is_content()
    if m.group() == "<|START_ACTION|>" and r.syntax.parse_tool_calls:
        r.pos = r.call_array(pj.skip_ws(r.text, r.pos), "tool_name", "parameters")
        r.close("<|END_ACTION|>")
    elif m.group() == "<|START_RESPONSE|>" and r.literal("<|END_RESPONSE|>") is None:
        return r.rest_is_content()
    r.rest_is_content()


def _granite(r: _Reader) -> None:
    """<think>...</think><response>...</response>, then <|tool_call|>[{"name", "arguments"}]."""
    r.reasoning(*THINK_TAGS[ChatFormat.GRANITE])
    i = pj.skip_ws(r.text, r.pos)
    if r.text.startswith("<response>", i):
        r.pos = i + len("<response>")
        if r.literal("</response>") is None:
            return r.rest_is_content()
    elif r.partial and i < len(r.text) and "<response>".startswith(r.text[i:]):
        raise Incomplete
    if r.syntax.parse_tool_calls and r.literal("<|tool_call|>") is not None:
        r.pos = r.call_array(pj.skip_ws(r.text, r.pos))
    r.rest_is_content()


_OSS_RECIPIENT = r"to=functions\.([^<\s]+)"
_OSS_CONSTRAINT = r"(?:\s*(?:<\|constrain\|>)?[a-zA-Z0-9_-]+)?"
_OSS_CALLS = (re.compile(_OSS_RECIPIENT + r"\s*<\|channel\|>(?:analysis|commentary)" + _OSS_CONSTRAINT),
              re.compile(r"<\|channel\|>(?:analysis|commentary)\s+" + _OSS_RECIPIENT + _OSS_CONSTRAINT))
_OSS_START = "<|start|>assistant"


def _gpt_oss(r: _Reader) -> None:
    """Harmony messages: <|channel|>analysis<|message|>... (reasoning), <|channel|>final<|message|>
    ... (content), and calls ` to=functions.NAME ... <|message|>{...}`, each message after a
    <|start|>assistant."""
    while True:
        k = r.text.find("<|message|>", r.pos)
        if k < 0:
            raise Incomplete
        header, r.pos = r.text[r.pos:k], k + len("<|message|>")
        call = next((m for m in (rx.fullmatch(header.strip()) for rx in _OSS_CALLS) if m), None)
        if call is not None:
            if r.syntax.parse_tool_calls:
                r.call_with_args(call.group(1))
            else:
                r.pos = pj.value_end(r.text, pj.skip_ws(r.text, r.pos))
        else:
            end = r.text.find("<|end|>", r.pos)
            cut = end if end >= 0 else partial_start(r.text, "<|end|>", r.pos) if r.partial else len(r.text)
            body = r.text[r.pos:cut]
            if header.strip().startswith("<|channel|>analysis") and r.syntax.reasoning:
                r.msg.reasoning_content += body.strip()
            else:
                r.msg.content += body
            r.pos = cut if end < 0 else end + len("<|end|>")
            if end < 0:
                if r.partial:
                    raise Incomplete
                return
        nxt = r.text.find(_OSS_START, r.pos)
        if nxt < 0:
            if r.partial and partial_start(r.text, _OSS_START, r.pos) < len(r.text):
                raise Incomplete
            return
        r.pos = nxt + len(_OSS_START)


PARSERS: dict[ChatFormat, Callable[[_Reader], None]] = {
    ChatFormat.CONTENT_ONLY: _content_only,
    ChatFormat.GENERIC: _generic,
    ChatFormat.HERMES_2_PRO: _hermes,
    ChatFormat.LLAMA_3_X: _llama_3_x,
    ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS: _llama_3_x,
    ChatFormat.DEEPSEEK_R1: _deepseek_r1,
    ChatFormat.MISTRAL_NEMO: _mistral_nemo,
    ChatFormat.FIREFUNCTION_V2: _firefunction_v2,
    ChatFormat.FUNCTIONARY_V3_2: _functionary_v3_2,
    ChatFormat.FUNCTIONARY_V3_1_LLAMA_3_1: _functionary_v3_1,
    ChatFormat.COMMAND_R7B: _command_r7b,
    ChatFormat.GRANITE: _granite,
    ChatFormat.GPT_OSS: _gpt_oss,
}


def parse(text: str, syntax: ChatSyntax, *, partial: bool = False) -> ChatMsg:
    """The reply `text` read in its format (common_chat_parse); `partial`: more text may come."""
    r = _Reader(text, syntax, partial)
    try:
        PARSERS[syntax.format](r)
    except Incomplete:
        if not partial:
            return _as_content(text, syntax, "its markup is cut")
    except ValueError as e:
        if not partial:
            return _as_content(text, syntax, str(e))
    return r.msg


def _as_content(text: str, syntax: ChatSyntax, why: str) -> ChatMsg:
    log.debug("a %s reply does not parse (%s): read as content", syntax.format.value, why)
    r = _Reader(text, replace(syntax, format=ChatFormat.CONTENT_ONLY), partial=False)
    if syntax.format in THINK_TAGS:
        r.reasoning(*THINK_TAGS[syntax.format])
    r.rest_is_content()
    return r.msg


# ---- the stream ----------------------------------------------------------------------------

@dataclass
class ToolCallDelta:
    index: int
    id: str = ""            # with the name, in a call's first delta
    name: str = ""
    arguments: str = ""

    def to_openai(self) -> dict:
        fn: dict = {"arguments": self.arguments}
        if self.name:
            fn = {"name": self.name, **fn}
        out: dict = {"index": self.index}
        if self.id:
            out.update(id=self.id, type="function")
        return {**out, "function": fn}


@dataclass
class MsgDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def nine_char_id() -> str:
    """Mistral Nemo's template wants 9 alphanumeric characters."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ChatStream:
    """One reply as it arrives: `feed` returns what is new since the last delta, `finish` the
    last delta; `message` is then the whole reply."""

    def __init__(self, syntax: ChatSyntax):
        self.syntax = syntax
        self.new_id = nine_char_id if syntax.format == ChatFormat.MISTRAL_NEMO else openai_call_id
        self.text = ""
        self.sent = ChatMsg()
        self.ids: list[str] = []
        self.message: ChatMsg | None = None

    def add(self, text: str) -> None:
        """More of the reply, not streamed (read once, by finish)."""
        self.text += text

    def feed(self, text: str) -> MsgDelta:
        self.text += text
        return self._delta(parse(self.text, self.syntax, partial=True))

    def finish(self) -> MsgDelta:
        msg = parse(self.text, self.syntax)
        delta = self._delta(msg)
        for call, call_id in zip(msg.tool_calls, self._ids(len(msg.tool_calls)), strict=True):
            call.id = call_id
        self.message = msg
        return delta

    def _ids(self, n: int) -> list[str]:
        while len(self.ids) < n:
            self.ids.append(self.new_id())
        return self.ids[:n]

    def _delta(self, msg: ChatMsg) -> MsgDelta:
        sent = self.sent
        d = MsgDelta(_grown(sent.content, msg.content), _grown(sent.reasoning_content, msg.reasoning_content))
        sent.content += d.content
        sent.reasoning_content += d.reasoning_content
        ids = self._ids(len(msg.tool_calls))
        for i, call in enumerate(msg.tool_calls):
            if i < len(sent.tool_calls):
                frag = _grown(sent.tool_calls[i].arguments, call.arguments)
                if frag:
                    d.tool_calls.append(ToolCallDelta(i, arguments=frag))
                    sent.tool_calls[i].arguments += frag
            else:
                d.tool_calls.append(ToolCallDelta(i, ids[i], call.name, call.arguments))
                sent.tool_calls.append(ToolCall(call.name, call.arguments, ids[i]))
        return d


def _grown(old: str, new: str) -> str:
    """What `new` adds to `old` (nothing when it does not extend it: a delta cannot be taken back)."""
    if new.startswith(old):
        return new[len(old):]
    log.debug("a reply's parse changed what was already streamed: %r -> %r", old[-40:], new[-40:])
    return ""
