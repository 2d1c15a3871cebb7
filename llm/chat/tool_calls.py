"""Tool calling for the chat API, in OpenAI's shapes, with the call constrained by a schema.

Like llama.cpp's generic tool-call format (for templates without a native one), the tools
are described to the model in a system message (and passed to the chat template as `tools`,
for templates that render them), and its reply is constrained by a JSON
schema built from the tools' parameter schemas: either {"tool_call": {"name", "arguments"}}
or, when tool_choice is "auto", {"response": "..."}. The reply is parsed into OpenAI's
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": JSON text}}]).
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Mapping

from llm.errors import GrammarError


def check_tools(tools) -> list[dict]:
    """OpenAI tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise GrammarError("tools: expected a non-empty list")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise GrammarError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise GrammarError(f"tools[{i}].function.name: a unique non-empty string is required, got {name!r}")
        names.add(name)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            raise GrammarError(f"tools[{i}].function.parameters: expected a JSON schema object")
    return list(tools)


def _chosen(tools: list[dict], tool_choice) -> tuple[list[dict], bool]:
    """The tools the model may call and whether a plain response is allowed."""
    if tool_choice in (None, "auto"):
        return tools, True
    if tool_choice == "required":
        return tools, False
    if isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        picked = [t for t in tools if t["function"]["name"] == name]
        if not picked:
            raise GrammarError(f"tool_choice: no tool named {name!r}")
        return picked, False
    raise GrammarError(f"tool_choice: expected 'auto', 'none', 'required' or a function, got {tool_choice!r}")


def reply_schema(tools: list[dict], tool_choice="auto") -> dict:
    """The JSON schema of the model's reply."""
    allowed, free_text = _chosen(tools, tool_choice)
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": dict(t["function"].get("parameters") or {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in allowed]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    options = [{"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                "additionalProperties": False}]
    if free_text:
        options.append({"type": "object", "properties": {"response": {"type": "string"}},
                        "required": ["response"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def system_prompt(tools: list[dict], tool_choice="auto") -> str:
    allowed, free_text = _chosen(tools, tool_choice)
    lines = ["You can call these tools:", json.dumps([t["function"] for t in allowed], indent=1), "",
             'To call a tool, reply with JSON only: {"tool_call": {"name": <tool name>, "arguments": {...}}}.']
    if free_text:
        lines.append('To answer without a tool, reply with JSON only: {"response": <your answer>}.')
    return "\n".join(lines)


def with_tools(messages: list[dict], tools: list[dict], tool_choice="auto") -> list[dict]:
    """The conversation with the tool description added to (or as) the system message, and
    earlier tool calls / tool results written as text every template can render."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps({"tool_call": calls[0]} if len(calls) == 1
                                                            else {"tool_calls": calls})}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"Tool result: {m.get('content', '')}"}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    prompt = system_prompt(tools, tool_choice)
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
