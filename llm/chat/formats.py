"""Chat formats: how a model writes tool calls and reasoning, detected from its chat template.

As llama.cpp's common/chat.cpp, the template's source decides the format by the markup it
contains (`<tool_call>` for Hermes 2 Pro / Qwen, `[TOOL_CALLS]` for Mistral Nemo, ...), checked
in llama.cpp's order; a template without any known markup gets the generic JSON format when
tools are given (llm.chat.tool_calls), and plain content otherwise. `ChatSyntax` is what the
parser of a reply needs to know (llama.cpp's common_chat_syntax).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class ChatFormat(enum.Enum):
    """llama.cpp's common_chat_format (the values are its common_chat_format_name)."""

    CONTENT_ONLY = "Content-only"
    GENERIC = "Generic"
    MISTRAL_NEMO = "Mistral Nemo"
    LLAMA_3_X = "Llama 3.x"
    LLAMA_3_X_WITH_BUILTIN_TOOLS = "Llama 3.x with builtin tools"
    DEEPSEEK_R1 = "DeepSeek R1"
    FIREFUNCTION_V2 = "FireFunction v2"
    FUNCTIONARY_V3_2 = "Functionary v3.2"
    FUNCTIONARY_V3_1_LLAMA_3_1 = "Functionary v3.1 Llama 3.1"
    HERMES_2_PRO = "Hermes 2 Pro"
    COMMAND_R7B = "Command R7B"
    GRANITE = "Granite"
    GPT_OSS = "GPT-OSS"


class ReasoningFormat(enum.Enum):
    """llama-server's --reasoning-format: where a reply's thinking goes. `none` leaves it in
    `content`; `deepseek` and `auto` (the default) put it in `reasoning_content`."""

    NONE = "none"
    DEEPSEEK = "deepseek"
    AUTO = "auto"


# formats that read a reply their own way also without tools (reasoning, Functionary's "all\n");
# the other native formats parse a reply to a request without tools as plain content
PARSED_WITHOUT_TOOLS = frozenset({ChatFormat.DEEPSEEK_R1, ChatFormat.COMMAND_R7B, ChatFormat.GRANITE,
                                  ChatFormat.HERMES_2_PRO, ChatFormat.GPT_OSS, ChatFormat.FUNCTIONARY_V3_2})

# the tags a format's reasoning is written between
THINK_TAGS: dict[ChatFormat, tuple[str, str]] = {
    ChatFormat.CONTENT_ONLY: ("<think>", "</think>"),
    ChatFormat.GENERIC: ("<think>", "</think>"),
    ChatFormat.HERMES_2_PRO: ("<think>", "</think>"),
    ChatFormat.DEEPSEEK_R1: ("<think>", "</think>"),
    ChatFormat.GRANITE: ("<think>", "</think>"),
    ChatFormat.COMMAND_R7B: ("<|START_THINKING|>", "<|END_THINKING|>"),
}

# control tokens whose text must reach the parser (llama.cpp's preserved_tokens)
PRESERVED: dict[ChatFormat, tuple[str, ...]] = {
    ChatFormat.CONTENT_ONLY: ("<think>", "</think>"),
    ChatFormat.GENERIC: ("<think>", "</think>"),
    ChatFormat.HERMES_2_PRO: ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    ChatFormat.DEEPSEEK_R1: ("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                             "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),
    ChatFormat.COMMAND_R7B: ("<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
                             "<|START_THINKING|>", "<|END_THINKING|>"),
    ChatFormat.GRANITE: ("<think>", "</think>", "<response>", "</response>", "<|tool_call|>"),
    ChatFormat.GPT_OSS: ("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>"),
    ChatFormat.MISTRAL_NEMO: ("[TOOL_CALLS]",),
    ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS: ("<|python_tag|>",),
    ChatFormat.FUNCTIONARY_V3_1_LLAMA_3_1: ("<|python_tag|>",),
    ChatFormat.FUNCTIONARY_V3_2: ("<|end_header_id|>",),
}


def detect(source: str, *, tools: bool, json_schema: bool) -> ChatFormat:
    """The format of a template, as common_chat_templates_apply_jinja picks its handler: `tools`
    when the request has tools to call, `json_schema` when its reply is constrained by one."""
    def has(*marks: str) -> bool:
        return all(m in source for m in marks)

    if has("<｜tool▁calls▁begin｜>") and not json_schema:
        return ChatFormat.DEEPSEEK_R1
    if has("<|END_THINKING|><|START_ACTION|>") and not json_schema:
        return ChatFormat.COMMAND_R7B
    if has("elif thinking", "<|tool_call|>"):
        return ChatFormat.GRANITE
    if has("<tool_call>") and not json_schema:
        return ChatFormat.HERMES_2_PRO
    if has("<|channel|>"):
        return ChatFormat.GPT_OSS
    if tools and json_schema:
        return ChatFormat.GENERIC
    if has(">>>all"):
        return ChatFormat.FUNCTIONARY_V3_2
    if has(" functools["):
        return ChatFormat.FIREFUNCTION_V2
    if has("<|start_header_id|>", "<function="):
        return ChatFormat.FUNCTIONARY_V3_1_LLAMA_3_1
    if has("<|start_header_id|>ipython<|end_header_id|>"):
        return ChatFormat.LLAMA_3_X_WITH_BUILTIN_TOOLS if has("<|python_tag|>") else ChatFormat.LLAMA_3_X
    if not tools:
        return ChatFormat.CONTENT_ONLY
    if has("[TOOL_CALLS]"):
        return ChatFormat.MISTRAL_NEMO
    return ChatFormat.GENERIC


@dataclass(frozen=True)
class ChatSyntax:
    """How to read a reply back (llama.cpp's common_chat_syntax)."""

    format: ChatFormat = ChatFormat.CONTENT_ONLY
    reasoning_format: ReasoningFormat = ReasoningFormat.AUTO
    thinking_forced_open: bool = False      # the prompt opened the reasoning block: the reply starts inside it
    parse_tool_calls: bool = False

    @property
    def reasoning(self) -> bool:
        return self.reasoning_format != ReasoningFormat.NONE
