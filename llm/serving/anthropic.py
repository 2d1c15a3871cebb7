"""Anthropic's Messages API on the chat machinery: POST /v1/messages and /v1/messages/count_tokens,
as llama-server serves them (its server_chat_convert_anthropic_to_oai and to_json_anthropic*).

A request is read into the same parts as a chat completion (llm.serving.requests): OpenAI-shaped
messages, ChatOptions (tools, tool_choice, thinking) and GenParams, so the model's own template,
tool-call format, grammar and reply parser (llm.chat) serve it unchanged. What is Anthropic's:

- `system` is a string or a list of text blocks; a message's `content` is a string or a list of
  blocks: `text`, `thinking` (an assistant's earlier reasoning), `tool_use` (an assistant's call:
  id, name, input object), `tool_result` (a user's answer to an earlier tool_use: tool_use_id,
  content as a string or text blocks). A user message's tool results become `tool` messages,
  before the rest of its text. Other blocks (images, documents) are refused: a 400 naming the
  block, as is any malformed one.
- `tools` carry `input_schema`; `tool_choice` is {"type": "auto" | "any" | "tool" (with `name`) |
  "none"} (several calls in one reply only with `disable_parallel_tool_use: false`);
  `max_tokens` is required; `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`,
  `thinking` ({"type": "disabled"} turns it off), llama-server's `chat_template_kwargs` and
  `cache_prompt`, and `seed` (not Anthropic's, nor passed on by llama-server: a reproducible reply).
- The reply is a `message` of content blocks (`thinking` first, then `text`, then `tool_use`)
  with stop_reason end_turn / max_tokens / stop_sequence / tool_use and usage; streamed as
  Anthropic's named SSE events: message_start, ping, content_block_start / _delta (text_delta,
  thinking_delta, input_json_delta) / _stop, message_delta, message_stop. Blocks are numbered in
  the order they open, one open at a time.
- Errors are {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}
  (`error_response`; create_app answers every error under /v1/messages so).
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llm.chat import tool_calls
from llm.chat.formats import ChatSyntax
from llm.chat.parsers import ChatStream, MsgDelta
from llm.chat.prompt import ChatOptions
from llm.generation.batcher import Done, Failed
from llm.generation.core import FINISH_LENGTH, FINISH_STOP, Delta, GenParams
from llm.params import ReasoningParams
from llm.serving.completions import Run, log_done
from llm.serving.requests import (
    MAX_STOP,
    APIError,
    _bool,
    _int,
    bad,
    chat_options,
    check_chat_bytes,
    gen_params,
    read_json,
)
from llm.serving.routes import chat_prompt_tokens, check_prompt_length, server_of
from llm.serving.sse import HEADERS
from llm.vocab import Vocab

router = APIRouter()

PREFIX = "/v1/messages"
# Anthropic's error type for each status (its API's errors page); others are api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
# the sampling fields passed on: llama-server's three, and `seed` (ours: a reproducible reply)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def error_object(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(e: APIError) -> JSONResponse:
    """An APIError in Anthropic's error shape (the field it names is in its message)."""
    return JSONResponse(error_object(e.status, e.message), status_code=e.status, headers=e.headers)


# ---- the request -------------------------------------------------------------------------

def _text(v, where: str) -> str:
    if not isinstance(v, str):
        raise bad(where, f"{where} must be a string, got {json.dumps(v)[:50]}")
    return v


def _block(b, where: str) -> tuple[str, dict]:
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise bad(where, f"{where} must be a content block: an object with a string 'type'")
    return b["type"], b


def _text_blocks(v, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(where, f"{where} must be a string or a list of text blocks")
    parts = []
    for j, b in enumerate(v):
        kind, b = _block(b, f"{where}[{j}]")
        if kind != "text":
            raise bad(f"{where}[{j}].type", f"{where}[{j}].type is '{kind}': only text blocks are supported here")
        parts.append(_text(b.get("text"), f"{where}[{j}].text"))
    return "".join(parts)


def anthropic_messages(body: dict) -> list[dict]:
    """`system` and `messages` as the OpenAI-shaped messages the chat template is given."""
    out: list[dict] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system")
        out.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' is required: a non-empty list of {role, content} objects")
    call_ids: set[str] = set()
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"{where}.role must be 'user' or 'assistant', got {json.dumps(role)[:50]}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        text, reasoning, calls, results = [], [], [], []
        for j, b in enumerate(content):
            at = f"{where}.content[{j}]"
            kind, b = _block(b, at)
            if kind == "text":
                text.append(_text(b.get("text"), f"{at}.text"))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if kind == "thinking":
                    reasoning.append(_text(b.get("thinking"), f"{at}.thinking"))
            elif kind == "tool_use" and role == "assistant":
                call_id, name = b.get("id"), b.get("name")
                if not isinstance(call_id, str) or not call_id:
                    raise bad(f"{at}.id", f"{at}.id must be a non-empty string")
                if not isinstance(name, str) or not name:
                    raise bad(f"{at}.name", f"{at}.name must be a non-empty string")
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise bad(f"{at}.input", f"{at}.input must be an object (the call's arguments)")
                calls.append({"id": call_id, "type": "function", "function": {"name": name,
                                                                              "arguments": json.dumps(args)}})
                call_ids.add(call_id)
            elif kind == "tool_result" and role == "user":
                use_id = b.get("tool_use_id")
                if not isinstance(use_id, str) or use_id not in call_ids:
                    raise bad(f"{at}.tool_use_id", f"{at}.tool_use_id: a tool result for {json.dumps(use_id)[:60]}, "
                                                   "which no earlier assistant message's tool_use block has as its id")
                result = "" if b.get("content") is None else _text_blocks(b["content"], f"{at}.content")
                if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                    raise bad(f"{at}.is_error", f"{at}.is_error must be a boolean")
                results.append({"role": "tool", "tool_call_id": use_id, "content": result})
            elif kind in ("text", "thinking", "redacted_thinking", "tool_use", "tool_result"):
                raise bad(f"{at}.type", f"{at}.type: a '{kind}' block cannot be in a {role} message")
            else:
                raise bad(f"{at}.type", f"{at}.type: content blocks of type {json.dumps(kind)[:40]} are not supported "
                                        "(text, thinking, tool_use and tool_result are)")
        out += results
        if text or calls or reasoning or not results:
            msg: dict = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
    return out


def anthropic_tools(body: dict) -> tuple[list[dict] | None, object, bool]:
    """`tools` as OpenAI tools (checked; errors name Anthropic's fields), `tool_choice` as
    OpenAI's, and whether parallel calls are allowed."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    oai: list[dict] | None = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "'tools' must be a list of {name, description, input_schema}")
        oai = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise bad(f"tools[{i}]", f"tools[{i}] must be an object {{name, description, input_schema}}")
            if t.get("type") not in (None, "custom"):
                raise bad(f"tools[{i}].type", f"tools[{i}].type is {json.dumps(t['type'])[:50]}: only client "
                                              "tools (with an input_schema) are supported")
            if t.get("description") is not None and not isinstance(t["description"], str):
                raise bad(f"tools[{i}].description", f"tools[{i}].description must be a string")
            if "input_schema" not in t:
                raise bad(f"tools[{i}].input_schema", f"tools[{i}].input_schema is required (a JSON schema)")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description"):
                fn["description"] = t["description"]
            oai.append({"type": "function", "function": fn})
        try:
            if oai:
                tool_calls.check_tools(oai)
        except tool_calls.ToolError as e:
            param = e.param.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
            raise bad(param, f"'{param}' is invalid: {str(e).removeprefix(e.param + ': ')}") from None
    parallel = False
    oai_choice: object = None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice", "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}, "
                                     f"got {json.dumps(choice)[:60]}")
        if kind == "tool":
            name = choice.get("name")
            if not any(t["function"]["name"] == name for t in oai or []):
                raise bad("tool_choice.name", f"'tool_choice.name': no tool named {json.dumps(name)[:50]}")
            oai_choice = {"type": "function", "function": {"name": name}}
        else:
            oai_choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if kind in ("any", "tool") and not oai:
            raise bad("tool_choice", f"'tool_choice' {kind!r} needs 'tools'")
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None and not isinstance(disable, bool):
            raise bad("tool_choice.disable_parallel_tool_use", "'tool_choice.disable_parallel_tool_use' must be "
                                                               "a boolean")
        parallel = disable is False     # unsaid: one call per reply, as llama-server has it
    return oai or None, oai_choice, parallel


def _stop_sequences(body: dict) -> list[str]:
    v = body.get("stop_sequences")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop_sequences", "'stop_sequences' must be a list of strings")
    if len(v) > MAX_STOP:
        raise bad("stop_sequences", f"'stop_sequences' has {len(v)} strings; at most {MAX_STOP}")
    return [s for s in v if s]


def _thinking(body: dict) -> bool:
    """`thinking`: {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}; whether it is on."""
    v = body.get("thinking")
    if v is None:
        return True
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking", "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                              "{\"type\": \"disabled\"}")
    _int(v, "budget_tokens", None, lo=0)
    return v["type"] != "disabled"


@dataclass(frozen=True)
class MessagesRequest:
    """POST /v1/messages (and /v1/messages/count_tokens, where max_tokens is not needed)."""

    messages: list[dict]
    params: GenParams
    stream: bool
    cache_prompt: bool
    chat: ChatOptions

    @classmethod
    def parse(cls, body: dict, *, n_slots: int, n_vocab: int, vocab: Vocab | None = None,
              n_ctx_slot: int | None = None, n_adapters: int = 0, reasoning: ReasoningParams | None = None,
              count_only: bool = False) -> MessagesRequest:
        if not count_only and body.get("max_tokens") is None:
            raise bad("max_tokens", "'max_tokens' is required (the most tokens to generate)")
        messages = anthropic_messages(body)
        check_chat_bytes(messages, vocab, n_ctx_slot)
        tools, choice, parallel = anthropic_tools(body)
        oai = {k: body[k] for k in SAMPLING_FIELDS if k in body}
        oai.update(max_tokens=body.get("max_tokens"), stop=_stop_sequences(body))
        gen = gen_params(oai, chat=True, n_slots=n_slots, n_vocab=n_vocab, n_adapters=n_adapters)
        chat = chat_options({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
                             "chat_template_kwargs": body.get("chat_template_kwargs")},
                            reasoning or ReasoningParams(), None)
        if not _thinking(body):
            chat = dataclasses.replace(chat, enable_thinking=False)
        if chat.calls_tools:
            gen = dataclasses.replace(gen, constraint=None)
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise bad("metadata", "'metadata' must be an object")
        return cls(messages, gen, _bool(body, "stream", False), _bool(body, "cache_prompt", False), chat)


# ---- the reply ---------------------------------------------------------------------------

Event = tuple[str, dict]        # (event name, data)


class Reply:
    """One message as its job's events arrive: the whole `message()`, or the stream's events."""

    def __init__(self, syntax: ChatSyntax, *, model_name: str, n_prompt: int, stream: bool):
        self.parser = ChatStream(syntax)
        self.stream = stream
        self.model_name, self.n_prompt = model_name, n_prompt
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.finish: str | None = None
        self.stop_word: str | None = None
        self.usage = {"input_tokens": n_prompt, "output_tokens": 0}
        self.done = False
        self.n_blocks = 0                       # blocks opened so far
        self.open: tuple[str, int] | None = None    # the open block: its kind ("thinking", "text", "tool_use:i"), index
        self.tool_blocks: dict[int, int] = {}   # tool call index -> block index

    # events in, stream events out

    def apply(self, ev) -> list[Event]:
        if isinstance(ev, Failed):
            raise APIError(500, f"generation failed: {ev.message}", type="server_error")
        if isinstance(ev, Done):
            cached = int(ev.timings.get("cache_n", 0))
            self.usage = {"input_tokens": ev.n_prompt_tokens - cached, "cache_read_input_tokens": cached,
                          "output_tokens": ev.n_completion_tokens}
            self.done = True
            return []
        assert isinstance(ev, Delta)
        last = ev.finish_reason is not None
        if last:
            self.finish, self.stop_word = ev.finish_reason, ev.stop_word
        if not self.stream:
            self.parser.add(ev.text)
            if last:
                self.parser.finish()
            return []
        if last:
            self.parser.add(ev.text)
            delta = self.parser.finish()
        else:
            delta = self.parser.feed(ev.text) if ev.text else MsgDelta()
        return self._events(delta)

    def _events(self, d: MsgDelta) -> list[Event]:
        out: list[Event] = []
        if d.reasoning_content:
            out += self._block("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
        if d.content:
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.tool_calls:
            if c.index not in self.tool_blocks:        # a call's first delta: its id and name
                out += self._block(f"tool_use:{c.index}", {"type": "tool_use", "id": c.id, "name": c.name,
                                                           "input": {}})
                self.tool_blocks[c.index] = self.n_blocks - 1
            if c.arguments and c.index in self.tool_blocks:
                out.append(("content_block_delta", {"type": "content_block_delta", "index": self.tool_blocks[c.index],
                                                    "delta": {"type": "input_json_delta",
                                                              "partial_json": c.arguments}}))
        return out

    def _block(self, kind: str, start: dict) -> list[Event]:
        """Open a block of `kind` unless it is the open one (closing the open one first)."""
        if self.open is not None and self.open[0] == kind and not kind.startswith("tool_use"):
            return []
        out = self._close()
        self.open = (kind, self.n_blocks)
        self.n_blocks += 1
        out.append(("content_block_start", {"type": "content_block_start", "index": self.open[1],
                                            "content_block": start}))
        return out

    def _delta(self, delta: dict) -> Event:
        assert self.open is not None
        return "content_block_delta", {"type": "content_block_delta", "index": self.open[1], "delta": delta}

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        kind, index = self.open
        self.open = None
        out: list[Event] = []
        if kind == "thinking":      # Anthropic's clients expect a signature before a thinking block ends
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    # the message

    def stop_reason(self) -> str:
        msg = self.parser.message
        if msg is not None and msg.tool_calls:
            return "tool_use"
        if self.finish == FINISH_LENGTH:
            return "max_tokens"
        if self.finish == FINISH_STOP:
            return "stop_sequence"
        return "end_turn"

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name}

    def start_events(self) -> list[Event]:
        msg = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": msg}), ("ping", {"type": "ping"})]

    def end_events(self) -> list[Event]:
        return [*self._close(),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": self.stop_reason(), "stop_sequence": self.stop_word},
                                   "usage": self.usage}),
                ("message_stop", {"type": "message_stop"})]

    def message(self) -> dict:
        msg = self.parser.message
        assert msg is not None
        content: list[dict] = []
        if msg.reasoning_content:
            content.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
        if msg.content:
            content.append({"type": "text", "text": msg.content})
        for c in msg.tool_calls:
            try:
                args = json.loads(c.arguments)
            except json.JSONDecodeError:
                args = {}
            content.append({"type": "tool_use", "id": c.id, "name": c.name,
                            "input": args if isinstance(args, dict) else {}})
        return {**self._head(), "content": content, "stop_reason": self.stop_reason(),
                "stop_sequence": self.stop_word, "usage": self.usage}


def sse_frame(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def anthropic_sse(events: AsyncIterator[Event], on_close: Callable[[], None]) -> StreamingResponse:
    """Anthropic's event stream: `event: NAME` and `data: {json}` per event, no [DONE]; an
    APIError while streaming is an `error` event that ends it. `on_close` runs however it ends."""
    async def frames() -> AsyncIterator[str]:
        try:
            async for name, data in events:
                yield sse_frame(name, data)
        except APIError as e:
            yield sse_frame("error", error_object(e.status, e.message))
        finally:
            on_close()

    return StreamingResponse(frames(), media_type="text/event-stream", headers=HEADERS)


async def stream_events(request: Request, run: Run, reply: Reply, pending: list) -> AsyncIterator[Event]:
    for e in reply.start_events():
        yield e
    queue = list(pending)
    while not reply.done:
        _, ev = queue.pop(0) if queue else await run.next(request, poll=False)
        for e in reply.apply(ev):
            yield e
    for e in reply.end_events():
        yield e
    log_done(request.url.path, run, reply.usage["input_tokens"] + reply.usage.get("cache_read_input_tokens", 0),
             reply.usage["output_tokens"], [reply.finish])


async def collect(request: Request, run: Run, reply: Reply, pending: list) -> dict:
    try:
        for _, ev in pending:
            reply.apply(ev)
        while not reply.done:
            reply.apply((await run.next(request))[1])
    except BaseException:
        run.cancel()
        raise
    log_done(request.url.path, run, reply.usage["input_tokens"] + reply.usage.get("cache_read_input_tokens", 0),
             reply.usage["output_tokens"], [reply.finish])
    return reply.message()


# ---- the routes --------------------------------------------------------------------------

async def _parse(request: Request, *, count_only: bool):
    server = server_of(request)
    body = await read_json(request)
    server.check_model(body)
    b = server.engine.batcher
    req = MessagesRequest.parse(body, n_slots=b.n_slots, n_vocab=server.vocab.n_tokens, vocab=server.vocab,
                                n_ctx_slot=b.n_ctx_slot, n_adapters=len(server.llm.adapters),
                                reasoning=server.reasoning, count_only=count_only)
    chat, tokens = await chat_prompt_tokens(server, req.messages, req.chat)
    if not count_only:
        check_prompt_length(server, tokens, "messages")
    return server, req, chat, tokens


@router.post("/v1/messages")
async def messages(request: Request):
    """Anthropic's Messages API (llama-server's /v1/messages)."""
    server, req, chat, tokens = await _parse(request, count_only=False)
    params = dataclasses.replace(req.params, constraint=chat.grammar or req.params.constraint,
                                 preserved_tokens=chat.preserved_tokens)
    run = Run(server.engine, [tokens], params, req.cache_prompt, prompt_field="messages")
    pending = await run.start(request)
    reply = Reply(chat.syntax, model_name=server.model_name, n_prompt=len(tokens), stream=req.stream)
    if req.stream:
        return anthropic_sse(stream_events(request, run, reply, pending), run.cancel)
    return JSONResponse(await collect(request, run, reply, pending))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's token count for a Messages request (`max_tokens` not needed)."""
    _, _, _, tokens = await _parse(request, count_only=True)
    return {"input_tokens": len(tokens)}


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


