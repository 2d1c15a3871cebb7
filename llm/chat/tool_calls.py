"""Tool calling for the chat API, in OpenAI's shapes: the tools and tool_choice of a request,
checked, and llama.cpp's generic tool-call format for templates without a native one.

The native formats (Hermes, Llama 3.x, Mistral Nemo, ...) are in llm.chat.formats, their
grammars in llm.chat.grammars and their parsers in llm.chat.parsers. In the generic format the
tools are described to the model in a system message (and passed to the chat template as
`tools`, for templates that render them), and its reply is constrained by a JSON schema built
from the tools' parameter schemas: {"tool_call": {"name", "arguments"}} ({"tool_calls": [...]}
with parallel calls) or, when tool_choice is "auto", {"response": "..."}. The reply is parsed into
OpenAI's `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": JSON text}}]).
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from llm.chat.grammars import ToolSpec
from llm.errors import GrammarError
from llm.sampling import structured


class ToolError(GrammarError):
    """A bad `tools` or `tool_choice`; `param` is where (`tools[1].function.parameters`)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_tools(tools) -> list[dict]:
    """OpenAI tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}],
    each `parameters` a valid JSON schema."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ToolError("tools", "expected a non-empty list")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise ToolError(f"tools[{i}]", "expected {'type': 'function', 'function': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise ToolError(f"tools[{i}].function.name", f"a unique non-empty string is required, got {name!r}")
        names.add(name)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            raise ToolError(f"tools[{i}].function.parameters", "expected a JSON schema object")
        try:
            structured.check_schema(params)
        except GrammarError as e:
            raise ToolError(f"tools[{i}].function.parameters", str(e).removeprefix("json_schema: ")) from None
    return list(tools)


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: "auto" (a call or an answer), "none" (no call), "required" (a call),
    or {"type": "function", "function": {"name"}} (a call of that one: mode "required")."""

    mode: str = "auto"
    function: str | None = None

    @classmethod
    def parse(cls, value, tools: list[dict]) -> ToolChoice:
        if value is None or value in ("auto", "none", "required"):
            return cls(value or "auto")
        if isinstance(value, Mapping) and isinstance(value.get("function"), Mapping):
            name = value["function"].get("name")
            if not any(t["function"]["name"] == name for t in tools):
                raise ToolError("tool_choice", f"no tool named {name!r}")
            return cls("required", name)
        raise ToolError("tool_choice", f"expected 'auto', 'none', 'required' or a function, got {value!r}")

    def allowed(self, tools: list[dict]) -> list[dict]:
        """The tools the reply may call."""
        return [t for t in tools if self.function in (None, t["function"]["name"])]


def tool_specs(tools: list[dict], choice: ToolChoice) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], dict(t["function"].get("parameters") or {"type": "object"}))
            for t in choice.allowed(tools)]


def _chosen(tools: list[dict], tool_choice) -> tuple[list[dict], bool]:
    """The tools the model may call and whether a plain response is allowed."""
    choice = tool_choice if isinstance(tool_choice, ToolChoice) else ToolChoice.parse(tool_choice, tools)
    return choice.allowed(tools), choice.mode == "auto"


def reply_schema(tools: list[dict], tool_choice="auto", *, parallel: bool = False,
                 response_schema: dict | None = None) -> dict:
    """The JSON schema of the model's reply (llama.cpp's common_chat_params_init_generic):
    a call ({"tool_calls": [...]} with `parallel`), or with tool_choice "auto" a response
    (`response_schema`, else a string)."""
    allowed, free_text = _chosen(tools, tool_choice)
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tool_specs(allowed, ToolChoice())]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        options = [{"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                    "required": ["tool_calls"], "additionalProperties": False}]
    else:
        options = [{"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                    "additionalProperties": False}]
    if free_text:
        options.append({"type": "object", "properties": {"response": response_schema or {"type": "string"}},
                        "required": ["response"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def system_prompt(tools: list[dict], tool_choice="auto", *, parallel: bool = False) -> str:
    allowed, free_text = _chosen(tools, tool_choice)
    call = ('{"tool_calls": [{"name": <tool name>, "arguments": {...}}, ...]}' if parallel
            else '{"tool_call": {"name": <tool name>, "arguments": {...}}}')
    lines = ["You can call these tools:", json.dumps([t["function"] for t in allowed], indent=1), "",
             f"To call a tool, reply with JSON only: {call}."]
    if free_text:
        lines.append('To answer without a tool, reply with JSON only: {"response": <your answer>}.')
    return "\n".join(lines)


def arguments_object(arguments):
    """A call's arguments as the object templates render (OpenAI sends JSON text); text that is
    not a JSON object stays text."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def with_tools(messages: list[dict], tools: list[dict], tool_choice="auto", *, parallel: bool = False) -> list[dict]:
    """The conversation with the tool description added to (or as) the system message, and
    earlier tool calls / tool results written as text every template can render."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": arguments_object(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps({"tool_call": calls[0]} if len(calls) == 1
                                                            else {"tool_calls": calls})}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"Tool result: {m.get('content', '')}"}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    prompt = system_prompt(tools, tool_choice, parallel=parallel)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def parse_reply(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) from the model's constrained reply; an unfinished reply (cut by
    max_tokens) is returned as content."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
        call = obj["tool_call"]
        return None, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                       "function": {"name": call.get("name"), "arguments": json.dumps(call.get("arguments", {}))}}]
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], None
    return text, None
