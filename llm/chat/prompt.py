"""A chat request's prompt, grammar and reply syntax from the model's template (llama.cpp's
common_chat_templates_apply).

The template's format (llm.chat.formats) decides what the template is given (most templates
render `tools` themselves; Llama 3.x wants a date, FireFunction its functions as text, the
generic format a system prompt), how earlier tool calls are passed (arguments as objects),
the grammar of the reply (llm.chat.grammars, or the generic reply schema) and how the reply
is read back (a ChatSyntax for llm.chat.parsers).

Reasoning: `enable_thinking` (also from chat_template_kwargs) is passed to the template; a
prompt that ends by opening the reasoning block makes the reply start inside it
(thinking_forced_open), or, with thinking off, gets the block closed, as llama.cpp does.
"""
from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from llm.chat import templates
from llm.chat.formats import (
    PARSED_WITHOUT_TOOLS,
    PRESERVED,
    THINK_TAGS,
    ChatFormat,
    ChatSyntax,
    ReasoningFormat,
    detect,
)
from llm.chat.grammars import control_tokens, tool_grammar
from llm.chat.tool_calls import ToolChoice, arguments_object, reply_schema, tool_specs, with_tools
from llm.sampling import structured
from llm.sampling.structured import GrammarSpec
from llm.vocab import Vocab

# variables render() itself sets: chat_template_kwargs may not replace them
RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "limits", "template"})
# llama.cpp's builtin tools of Llama 3.1 (written as <|python_tag|>name.call(...))
BUILTIN_TOOLS = ("wolfram_alpha", "web_search", "brave_search", "python", "code_interpreter")


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request asks besides its messages (llama.cpp's common_chat_templates_inputs):
    its tools (checked: llm.chat.tool_calls.check_tools) and tool_choice, parallel calls, a
    schema for the reply, where reasoning goes, thinking on or off, and extra template variables."""

    tools: tuple[dict, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = False
    json_schema: dict | None = None
    reasoning_format: ReasoningFormat = ReasoningFormat.AUTO
    enable_thinking: bool = True
    chat_template_kwargs: Mapping = field(default_factory=dict)
    add_generation_prompt: bool = True

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def thinking(self) -> bool:
        """enable_thinking, unless chat_template_kwargs says otherwise (as llama-server reads it)."""
        v = self.chat_template_kwargs.get("enable_thinking")
        return v if isinstance(v, bool) else self.enable_thinking


@dataclass(frozen=True)
class ChatPrompt:
    """The rendered prompt, the reply's grammar (None: unconstrained), the control tokens whose
    text the reply keeps, and how to read the reply (llama.cpp's common_chat_params)."""

    prompt: str
    syntax: ChatSyntax
    grammar: GrammarSpec | None = None
    preserved_tokens: frozenset[int] = frozenset()


def template_messages(messages: list[dict], fmt: ChatFormat) -> list[dict]:
    """Messages as templates read them: no None content, tool-call arguments as objects; a call's
    reasoning as Command R7B's tool_plan or gpt-oss's thinking."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": arguments_object(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            if m.get("reasoning_content") and fmt == ChatFormat.COMMAND_R7B:
                m["tool_plan"] = m.pop("reasoning_content")
            elif m.get("reasoning_content") and fmt == ChatFormat.GPT_OSS:
                m["thinking"] = m["reasoning_content"]
        out.append(m)
    return out


def _context(fmt: ChatFormat, tools: list[dict], options: ChatOptions) -> dict:
    """The template variables a format's handler passes besides the messages."""
    ctx: dict = {"enable_thinking": options.thinking}
    if fmt == ChatFormat.FIREFUNCTION_V2:
        ctx.update(functions=json.dumps(tools, indent=2) if tools else "",
                   datetime=datetime.datetime.now().strftime("%b %d %Y %H:%M:%S GMT"))
    elif tools:
        ctx["tools"] = tools
    if fmt in (ChatFormat.LLAMA_3_X, ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS):
        ctx.update(date_string=datetime.datetime.now().strftime("%d %b %Y"), tools_in_user_message=False)
        builtin = [t["function"]["name"] for t in tools if t["function"]["name"] in BUILTIN_TOOLS]
        if builtin and fmt == ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS:
            ctx["builtin_tools"] = builtin
    if fmt == ChatFormat.GRANITE:
        ctx["thinking"] = options.thinking
    ctx.update(options.chat_template_kwargs)
    return ctx


def check_template_kwargs(kwargs: Mapping) -> None:
    """ValueError for chat_template_kwargs that would replace what the renderer sets."""
    clash = sorted(RESERVED_KWARGS.intersection(kwargs))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")


def _thinking_open(prompt: str, fmt: ChatFormat, thinking: bool) -> tuple[str, bool]:
    """The prompt, and whether the reply starts inside the reasoning block the prompt opened; with
    thinking off an opened block is closed (or an empty one added for Command R7B)."""
    if fmt not in THINK_TAGS:
        return prompt, False
    start, end = THINK_TAGS[fmt]
    if prompt.rstrip("\n").endswith(start):
        if not thinking or fmt == ChatFormat.GENERIC:      # the generic reply is JSON from its first token
            return prompt + end, False
        return prompt, True
    if fmt == ChatFormat.COMMAND_R7B and not thinking and prompt.endswith("<|CHATBOT_TOKEN|>"):
        return prompt + start + end, False
    return prompt, False


def apply(template: str, messages: list[dict], options: ChatOptions, *, vocab: Vocab,
          bos_token: str = "", eos_token: str = "") -> ChatPrompt:
    """The prompt of `messages` under `template`, with the grammar and syntax of the reply.
    ChatTemplateError when the template fails, GrammarError when the tools' grammar does."""
    check_template_kwargs(options.chat_template_kwargs)
    tools = list(options.tools) if options.calls_tools else []
    fmt = detect(template, tools=bool(tools), json_schema=options.json_schema is not None)
    if fmt == ChatFormat.GENERIC:
        messages = with_tools(messages, tools, options.tool_choice, parallel=options.parallel_tool_calls)
    prompt = templates.render(template, template_messages(messages, fmt),
                              add_generation_prompt=options.add_generation_prompt, bos_token=bos_token,
                              eos_token=eos_token, **_context(fmt, tools, options))
    forced = False
    if options.add_generation_prompt:
        prompt, forced = _thinking_open(prompt, fmt, options.thinking)
    grammar = None
    if tools and fmt == ChatFormat.GENERIC:
        grammar = structured.spec_json_schema(reply_schema(tools, options.tool_choice,
                                                           parallel=options.parallel_tool_calls,
                                                           response_schema=options.json_schema))
    elif tools:
        grammar = tool_grammar(fmt, tool_specs(tools, options.tool_choice),
                               required=options.tool_choice.mode == "required",
                               parallel=options.parallel_tool_calls, thinking_forced_open=forced, vocab=vocab)
    control = control_tokens(vocab)
    preserved = frozenset(control[t] for t in PRESERVED.get(fmt, ()) if t in control)
    parse_format = fmt if tools or fmt in PARSED_WITHOUT_TOOLS else ChatFormat.CONTENT_ONLY
    syntax = ChatSyntax(parse_format, options.reasoning_format, forced, parse_tool_calls=bool(tools))
    return ChatPrompt(prompt, syntax, grammar, preserved)
