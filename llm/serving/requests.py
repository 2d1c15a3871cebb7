"""Typed request parsing for the HTTP routes: a JSON body in, a checked dataclass (or an
APIError naming the bad field) out.

The field readers (`_int`, `_num`, `_bool`, `_stop`, `_logit_bias`) check one field each;
`gen_params` reads the generation fields every completion-style route shares. Each route's
body has a dataclass with a `parse` classmethod (ChatCompletionRequest, CompletionRequest,
EmbeddingRequest, TokenizeRequest, DetokenizeRequest), so a handler only sees checked values.
Another API's shape (Anthropic's /v1/messages, say) gets its own dataclass next to these,
built from the same readers.

Parsers that tokenize take the tokenizer as an argument and are called off the event loop.
Given the vocabulary and the token limit, they first refuse a text whose byte length alone
proves it has too many tokens (`max_token_bytes`), so a huge prompt is not tokenized for nothing.

`read_json` bounds what a body may be before any field is read: its size, how fast it arrives,
its nesting depth, and text that is not Unicode (a lone surrogate escape such as "\\ud800").
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from llm import params
from llm.chat import prompt as prompt_mod
from llm.chat import tool_calls
from llm.chat.formats import ReasoningFormat
from llm.chat.prompt import ChatOptions
from llm.errors import GrammarError
from llm.generation.core import MAX_TOP_LOGPROBS, GenParams
from llm.mtmd.bitmap import default_marker
from llm.params import ReasoningParams
from llm.sampling import structured as grammar_mod
from llm.sampling.samplers import SamplingParams
from llm.tokenizers.bpe import BPETokenizer
from llm.tokenizers.spm import SPMTokenizer
from llm.tokenizers.unicode import byte_encode
from llm.vocab import TokenAttr, Vocab

MAX_BODY_BYTES = 8 << 20
# JSON containers nested deeper than this in a body are refused (json.loads recurses, and so do
# the schema checks after it)
MAX_JSON_DEPTH = 64
MAX_STOP = 16
# OpenAI's limits for one embeddings request: inputs, and tokens over all of them
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_TOKENS = 300_000
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Tokenize = Callable[[str], list[int]]

# an absolute filesystem path in an error message, quoted (as OSError shows it: it may hold
# spaces; group 2 is its last part) or bare (not a URL's "//host", nor "a/b" inside a word;
# group 1 is its last part)
_QUOTED_PATH = re.compile(r"(['\"])/(?:[^'\"\n]*/)?([^'\"\n/]*)\1")
_BARE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"`,;()\[\]{}<>]+/)*([^\s/'\"`,;:()\[\]{}<>]+)")


def scrub_paths(message: str) -> str:
    """The message with every absolute path replaced by its last component: an error body must
    not show the server's directories (the slot directory, the model's path)."""
    return _BARE_PATH.sub(r"\1", _QUOTED_PATH.sub(r"\1\2\1", message))


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        message = scrub_paths(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def bad(param: str, message: str) -> APIError:
    """A 400 for the request field `param`."""
    return APIError(400, message, param=param)



async def read_json(request: Request) -> dict:
    """The JSON object in the body: 413 past MAX_BODY_BYTES, 408 when no data comes for the
    server's body timeout (`app.state.body_timeout`, serve --timeout), 400 when it is not JSON,
    is nested deeper than MAX_JSON_DEPTH or holds a string that is not Unicode."""
    return await run_in_threadpool(parse_json, await read_body(request))


async def read_json_list(request: Request) -> list:
    """A body that is a JSON array (POST /lora-adapters), with read_json's limits."""
    return await run_in_threadpool(parse_json, await read_body(request), array=True)


async def read_body(request: Request) -> bytes:
    """The body's bytes, with the size limit and the body timeout."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {size} bytes is over the {MAX_BODY_BYTES} byte limit",
                       code="request_too_large")
    timeout = request.app.state.body_timeout
    body = bytearray()
    chunks = request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), timeout)
        except StopAsyncIteration:
            break
        except ClientDisconnect:      # nobody is left to answer; not a server error
            raise APIError(400, "the client disconnected while sending the request body",
                           code="client_disconnected") from None
        except TimeoutError:
            raise APIError(408, f"no request body data for {timeout:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is over the {MAX_BODY_BYTES} byte limit", code="request_too_large")
    return bytes(body)


def _non_finite(literal: str):
    """json.loads' hook for NaN / Infinity / -Infinity: not JSON (RFC 8259), so refused."""
    raise APIError(400, f"malformed JSON in the request body: {literal} is not a JSON number")


def parse_json(body: bytes, *, array: bool = False):
    """The body's JSON object (a JSON array with `array`), checked by check_json. Run off the
    event loop: an 8 MiB body of millions of small values takes seconds to parse and walk."""
    try:
        obj = json.loads(body, parse_constant=_non_finite)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="json_too_deep") from None
    if array:
        if not isinstance(obj, list):
            raise APIError(400, "the request body must be a JSON array")
        check_json(dict(enumerate(obj)))
        return obj
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json(obj)
    return obj


def check_json(obj: dict[str, Any] | dict[int, Any]) -> None:
    """APIError 400 when the parsed body `obj` nests containers deeper than MAX_JSON_DEPTH or
    holds a string or key that is not valid Unicode (a lone surrogate: JSON can spell one as an
    escape, and UTF-8 cannot encode it), naming where. Depth-first without recursion: a stack of
    the open containers' iterators and the keys that lead to them."""
    keys: list[str | int] = []
    iterators: list = [iter(obj.items())]
    while iterators:
        for key, v in iterators[-1]:
            if isinstance(key, str):
                _check_text(key, keys, key)
            if isinstance(v, str):
                _check_text(v, keys, key)
            elif isinstance(v, (dict, list)) and v:
                if len(iterators) == MAX_JSON_DEPTH:
                    top = _json_path(keys[:1])
                    raise APIError(400, f"'{top}' is nested deeper than {MAX_JSON_DEPTH} levels", param=top,
                                   code="json_too_deep")
                keys.append(key)
                iterators.append(iter(v.items() if isinstance(v, dict) else enumerate(v)))
                break
        else:
            iterators.pop()
            if keys:
                keys.pop()


def _check_text(s: str, keys: list[str | int], key: str | int) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        path = _json_path([*keys, key])
        raise APIError(400, f"'{path}' holds the lone surrogate \\u{ord(s[e.start]):04x} at character {e.start}: "
                            "not valid Unicode text", param=path, code="invalid_unicode") from None


def _json_path(keys: list[str | int]) -> str:
    """`messages[0].content` for the keys leading there (keys that are not Unicode escaped)."""
    parts = [f"[{k}]" if isinstance(k, int) else "." + k.encode("utf-8", "backslashreplace").decode("utf-8")
             for k in keys]
    return "".join(parts).removeprefix(".")


# ---- request fields ----------------------------------------------------------------------

def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer, got {json.dumps(v)[:50]}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"'{name}' must be {rng}, got {v}")
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"'{name}' must be a number, got {json.dumps(v)[:50]}")
    if not lo <= v <= hi:
        raise bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {json.dumps(v)[:50]}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' has {len(stops)} strings; at most {MAX_STOP}")
    return [s for s in stops if s]


def _logit_bias(body: dict, n_vocab: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except ValueError:
            raise bad("logit_bias", f"'logit_bias' key {k!r} is not a token id") from None
        if not 0 <= tok < n_vocab:
            raise bad("logit_bias", f"'logit_bias' token {tok} is out of range [0, {n_vocab})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100]")
        out[tok] = float(b)
    return out


def check_model(body: dict, names: Collection[str], model_name: str) -> None:
    """`model`, when given, must name this server's model (`model_name` or an alias in `names`)."""
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad("model", "'model' must be a string")
    if m not in names:
        shown = m if len(m) <= 100 else m[:100] + "..."
        raise APIError(400, f"the model '{shown}' does not exist; this server has '{model_name}'",
                       param="model", code="model_not_found")


def stream_fields(body: dict) -> tuple[bool, bool]:
    """`stream` and `stream_options.include_usage`."""
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    include_usage = _bool(opts or {}, "include_usage", False)
    return stream, include_usage


# ---- generation --------------------------------------------------------------------------

def sampling_params(body: dict, n_vocab: int) -> SamplingParams:
    """SamplingParams from the request fields its fields declare (llama-server's names:
    temperature, top_k, top_p, min_p, typical_p, repeat_penalty, dry_multiplier, mirostat, seed,
    samplers, ...; see llm/params.py); logit_bias is checked against the vocabulary here."""
    try:
        values = params.from_json(SamplingParams, {k: v for k, v in body.items() if k != "logit_bias"})
    except params.ParamError as e:
        raise bad(e.name, str(e)) from None
    return SamplingParams(**values, logit_bias=_logit_bias(body, n_vocab))


def _speculative(body: dict) -> str | None:
    """`speculative`: "prompt-lookup" drafts each sample's next tokens from its prompt and output."""
    v = body.get("speculative")
    if v is not None and v != "prompt-lookup":
        raise bad("speculative", f"'speculative' must be \"prompt-lookup\" or null, got {json.dumps(v)[:50]}")
    return v


def lora_scales(entries, n_adapters: int, field: str = "lora") -> tuple[float, ...]:
    """llama-server's adapter list [{"id": i, "scale": s}, ...] as one scale per loaded adapter;
    an adapter not in the list gets 0 (as llama-server's parse_lora_request)."""
    if not isinstance(entries, list):
        raise bad(field, f"'{field}' must be a list of {{\"id\": int, \"scale\": number}}")
    scales = [0.0] * n_adapters
    for i, e in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(e, dict):
            raise bad(where, f"'{where}' must be an object {{\"id\": int, \"scale\": number}}")
        k, v = e.get("id"), e.get("scale", 0.0)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n_adapters:
            raise bad(f"{where}.id", f"'{where}.id' must be the id of a loaded adapter (0..{n_adapters - 1}), "
                                     f"got {json.dumps(k)[:50]}" if n_adapters else
                      "the server has no LoRA adapters (start it with --lora FILE)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(f"{where}.scale", f"'{where}.scale' must be a number, got {json.dumps(v)[:50]}")
        scales[k] = float(v)
    return tuple(scales)


def gen_params(body: dict, *, chat: bool, n_slots: int, n_vocab: int, n_adapters: int = 0) -> GenParams:
    """GenParams from the OpenAI fields: length, choices, logprobs (chat's or the legacy
    completions' spelling), sampling, response_format and stop; llama-server's `lora` (this
    request's scales of the server's adapters) and `n_keep` / `n_discard` (context shift)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None if chat else 16, lo=1)
    n = _int(body, "n", 1, lo=1)
    if n > n_slots:
        raise bad("n", f"'n' = {n} is more than the server's {n_slots} slots")
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    else:
        top = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        logprobs = top is not None
        top = top or 0
    sampling = sampling_params(body, n_vocab)
    lora = None if body.get("lora") is None else lora_scales(body["lora"], n_adapters)
    return GenParams(max_tokens=max_tokens, sampling=sampling, stop=_stop(body), n=n, logprobs=logprobs,
                     top_logprobs=top, constraint=_constraint(body), speculative=_speculative(body), lora=lora,
                     n_keep=_int(body, "n_keep", 0, lo=-1), n_discard=_int(body, "n_discard", 0, lo=0))


def _response_schema(body: dict) -> dict | None:
    """The JSON schema a (checked) response_format asks for, if any."""
    rf = body.get("response_format")
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        return None
    if rf["type"] == "json_schema":
        return rf["json_schema"]["schema"]
    return rf.get("schema") or {"type": "object"}


def _constraint(body: dict) -> grammar_mod.GrammarSpec | None:
    """`response_format` (OpenAI) or `grammar` (GBNF text, as llama-server takes it), not both."""
    gbnf = body.get("grammar")
    if gbnf is not None:
        if not isinstance(gbnf, str):
            raise bad("grammar", f"'grammar' must be GBNF text (a string), got {json.dumps(gbnf)[:50]}")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise bad("grammar", "'grammar' and 'response_format' both constrain the output: pass one")
        try:
            return grammar_mod.spec_gbnf(gbnf)
        except GrammarError as e:
            raise bad("grammar", f"'grammar' is invalid: {e}") from None
    try:
        return grammar_mod.spec_response_format(body.get("response_format"))
    except GrammarError as e:
        raise bad("response_format", f"'response_format' is invalid: {e}") from None

# ---- inputs ------------------------------------------------------------------------------

_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_bytes(vocab: Vocab) -> int | None:
    """The most bytes of text one token stands for (None where no bound holds), once per vocabulary:
    a text of B bytes has at least B / max_token_bytes tokens, so a prompt that surely cannot fit
    is refused before it is tokenized (a 7.5 MB prompt took 9.5 s to tokenize).

    A token stands for at most its GGUF text's length in bytes (SPM spells a space as the 3-byte
    U+2581, byte-level BPE a byte as a 1- or 2-byte character; a byte or unknown token stands for
    one byte), provided tokenizing drops no byte of the text; see `_keeps_every_byte`. A very long
    token only makes the bound looser, never wrong.
    """
    if vocab not in _MAX_TOKEN_BYTES:
        _MAX_TOKEN_BYTES[vocab] = max(1, max(map(len, vocab.texts))) if _keeps_every_byte(vocab) else None
    return _MAX_TOKEN_BYTES[vocab]


def _keeps_every_byte(vocab: Vocab) -> bool:
    """Whether every byte of a text ends up in some token. Not where a token strips the whitespace
    around it (LSTRIP / RSTRIP), nor for WPM and UGM (they normalize whitespace and accents away),
    nor where BPE lacks a byte's character or a merge's result (that symbol is dropped), nor where
    SPM has neither a byte token nor an unknown token for some byte."""
    if any(a & (TokenAttr.LSTRIP | TokenAttr.RSTRIP) for a in vocab.attrs):
        return False
    tok = vocab.tokenizer
    if isinstance(tok, BPETokenizer):
        return (all(byte_encode(bytes([b])) in tok.token_to_id for b in range(256))
                and all(a + b in tok.token_to_id for a, b in tok.ranks))
    if isinstance(tok, SPMTokenizer):
        return all(tok.byte_fallback)
    return False


def min_tokens(text: str, vocab: Vocab | None) -> int:
    """A lower bound on the number of tokens of `text` (0 without a vocabulary or a bound)."""
    most = None if vocab is None else max_token_bytes(vocab)
    return 0 if most is None else math.ceil(len(text.encode("utf-8")) / most)


def _too_long(param: str, n_min: int, n_ctx: int) -> APIError:
    return APIError(400, f"the prompt has at least {n_min} tokens (from its length in bytes); a slot holds {n_ctx}",
                    param=param, code="context_length_exceeded")


def _token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def embedding_inputs(body: dict, tokenize: Tokenize, n_vocab: int, *, vocab: Vocab | None = None,
                     max_input_tokens: int | None = None) -> list[list[int]]:
    """`input` as a string, a list of token ids, or a list of strings / token lists. With `vocab`,
    inputs that surely hold more than MAX_EMBEDDING_TOKENS tokens, or one input more than
    `max_input_tokens` (LLM.embed pools an input in one ubatch), are refused before anything is
    tokenized."""
    v = body.get("input")
    err = bad("input", "'input' must be a non-empty string, a list of token ids, or a list of those")
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise err
    if _token_list(v):
        v = [v]
    if len(v) > MAX_EMBEDDING_INPUTS:
        raise bad("input", f"'input' has {len(v)} items; at most {MAX_EMBEDDING_INPUTS} per request")
    at_least = [min_tokens(x, vocab) if isinstance(x, str) else len(x) if isinstance(x, list) else 0 for x in v]
    if sum(at_least) > MAX_EMBEDDING_TOKENS:
        raise bad("input", f"'input' has more than {MAX_EMBEDDING_TOKENS} tokens; split it over requests")
    for i, n in enumerate(at_least):
        if max_input_tokens is not None and n > max_input_tokens:
            raise bad("input", f"'input' item {i} has at least {n} tokens; an input may have {max_input_tokens} "
                               "(it is pooled in one ubatch)")
    out: list[list[int]] = []
    n_tokens = 0
    for x in v:
        if isinstance(x, str) and x:
            out.append(tokenize(x))
        elif _token_list(x):
            if not all(0 <= t < n_vocab for t in x):
                raise bad("input", f"'input' token ids must be in [0, {n_vocab})")
            out.append(list(x))
        else:
            raise err
        n_tokens += len(out[-1])
        if n_tokens > MAX_EMBEDDING_TOKENS:
            raise bad("input", f"'input' has more than {MAX_EMBEDDING_TOKENS} tokens; split it over requests")
    return out


def chat_messages(body: dict) -> list[dict]:
    """`messages` as {role, content} dicts; content parts joined, `developer` read as `system`.
    An assistant message may carry `tool_calls` (its content then may be null) and its
    `reasoning_content`; a `tool` message answers one of the calls before it by `tool_call_id`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                              f"got {json.dumps(role)[:50]}")
        if isinstance(content, list):   # content parts: text, and images as media markers
            content = "".join(_content_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content))
        msg: dict = {"role": "system" if role == "developer" else role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            call_ids.update(c["id"] for c in msg["tool_calls"])
            content = "" if content is None else content
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        msg["content"] = content
        for key in ("reasoning_content", "name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key}", f"messages[{i}].{key} must be a string")
                msg[key] = m[key]
        if role == "tool" and msg.get("tool_call_id") not in call_ids:
            raise bad(f"messages[{i}].tool_call_id",
                      f"messages[{i}] is a tool result for {json.dumps(m.get('tool_call_id'))[:60]}, which no "
                      "earlier assistant message's tool_calls has as its id")
        out.append(msg)
    return out


AUDIO_FORMATS = ("wav", "mp3", "flac")      # input_audio formats (the decoder tells them apart by content)


def _content_part(part, where: str) -> str:
    """A content part's text: a text part's own, an image_url or input_audio part's media marker
    (llama-server's oaicompat_content_load_media); media_parts lists the media."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image_url":
        ref = part.get("image_url")
        if not isinstance(ref, dict) or not isinstance(ref.get("url"), str) or not ref["url"]:
            raise bad(where, f"{where}: an image_url part must be {{\"type\": \"image_url\", \"image_url\": "
                             "{\"url\": \"data:image/...;base64,...\"}}")
        return default_marker()
    if kind == "input_audio":
        ref = part.get("input_audio")
        if not isinstance(ref, dict) or not isinstance(ref.get("data"), str) or ref.get("format") not in AUDIO_FORMATS:
            raise bad(where, f"{where}: an input_audio part must be {{\"type\": \"input_audio\", \"input_audio\": "
                             "{\"data\": base64, \"format\": \"wav\" | \"mp3\" | \"flac\"}}")
        return default_marker()
    raise bad(where, f"{where} must be {{\"type\": \"text\", \"text\": string}}, {{\"type\": \"input_audio\", ...}} "
                     "or {\"type\": \"image_url\", \"image_url\": {\"url\": string}}")


@dataclass(frozen=True)
class MediaPart:
    """An image_url or input_audio content part: where it is in the request and its URL (an
    input_audio part's data as a data URL)."""

    where: str      # messages[i].content[j]
    url: str


def media_parts(body: dict) -> list[MediaPart]:
    """The image_url and input_audio parts of the (checked, chat_messages) messages, in prompt order."""
    def url(p: dict) -> str:
        if p["type"] == "image_url":
            return p["image_url"]["url"]
        return f"data:audio/{p['input_audio']['format']};base64,{p['input_audio']['data']}"
    return [MediaPart(f"messages[{i}].content[{j}]", url(p))
            for i, m in enumerate(body["messages"]) if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"]) if p.get("type") in ("image_url", "input_audio")]


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text (an object is written as its JSON)}}]."""
    if not isinstance(calls, list):
        raise bad(where, f"{where} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise bad(f"{where}[{j}]", f"{where}[{j}] must be {{\"id\", \"type\": \"function\", "
                                       "\"function\": {\"name\", \"arguments\"}}")
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise bad(f"{where}[{j}].id", f"{where}[{j}].id must be a non-empty string")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{where}[{j}].function.name", f"{where}[{j}].function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args)
        if not isinstance(args, str):
            raise bad(f"{where}[{j}].function.arguments", f"{where}[{j}].function.arguments must be JSON text")
        out.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_options(body: dict, reasoning: ReasoningParams, json_schema: dict | None) -> ChatOptions:
    """The chat fields of a request (tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
    reasoning_format) over the server's reasoning settings; a reasoning budget of 0 turns
    thinking off. `json_schema`: the reply's schema from response_format."""
    tools: list[dict] = []
    try:
        if body.get("tools") is not None:
            tools = tool_calls.check_tools(body["tools"])
        choice = tool_calls.ToolChoice.parse(body.get("tool_choice"), tools)
    except tool_calls.ToolError as e:
        raise bad(e.param, f"'{e.param}' is invalid: {str(e).removeprefix(e.param + ': ')}") from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables")
    try:
        prompt_mod.check_template_kwargs(kwargs or {})
    except ValueError as e:
        raise bad("chat_template_kwargs", str(e)) from None
    fmt = body.get("reasoning_format", reasoning.reasoning_format)
    names = [f.value for f in ReasoningFormat]
    if fmt not in names:
        raise bad("reasoning_format", f"'reasoning_format' must be one of {', '.join(names)}, "
                                      f"got {json.dumps(fmt)[:50]}")
    return ChatOptions(tools=tuple(tools), tool_choice=choice,
                       parallel_tool_calls=_bool(body, "parallel_tool_calls", False), json_schema=json_schema,
                       reasoning_format=ReasoningFormat(fmt), enable_thinking=reasoning.reasoning_budget != 0,
                       chat_template_kwargs=kwargs or {})


def check_chat_bytes(messages: list[dict], vocab: Vocab | None, n_ctx_slot: int | None) -> None:
    """context_length_exceeded, before the template runs, for messages that surely do not fit a
    slot. A chat template renders the content of every user, system and tool message, trimmed at
    most; an assistant message is not counted, as a template may cut it (Qwen3's drops the
    reasoning of earlier turns). The markup only adds tokens."""
    if n_ctx_slot is None:
        return
    n = min_tokens("".join(m["content"].strip() for m in messages if m["role"] != "assistant"), vocab)
    if n >= n_ctx_slot:
        raise _too_long("messages", n, n_ctx_slot)


def completion_prompts(body: dict, tokenize: Tokenize, *, vocab: Vocab | None = None,
                       n_ctx_slot: int | None = None) -> list[list[int]]:
    """`prompt` as a string, a list of token ids, or a list of either (one job each). With `vocab`,
    a string that surely has `n_ctx_slot` tokens or more is refused before any is tokenized."""
    p = body.get("prompt")
    err = bad("prompt", "'prompt' must be a string, a list of token ids, or a list of strings / token lists")
    for text in [p] if isinstance(p, str) else p if isinstance(p, list) else []:
        n = min_tokens(text, vocab) if isinstance(text, str) else 0
        if n_ctx_slot is not None and n >= n_ctx_slot:
            raise _too_long("prompt", n, n_ctx_slot)
    if isinstance(p, str):
        return [tokenize(p)]
    if not isinstance(p, list) or not p:
        raise err
    if _token_list(p):
        return [list(p)]
    out = []
    for x in p:
        if isinstance(x, str):
            out.append(tokenize(x))
        elif _token_list(x):
            out.append(list(x))
        else:
            raise err
    return out


# ---- one dataclass per route -------------------------------------------------------------

@dataclass(frozen=True)
class ChatCompletionRequest:
    """POST /v1/chat/completions."""

    messages: list[dict]
    params: GenParams
    stream: bool
    include_usage: bool
    cache_prompt: bool
    chat: ChatOptions
    media: list[MediaPart]          # the image_url parts; each is a media marker in `messages`

    @classmethod
    def parse(cls, body: dict, *, n_slots: int, n_vocab: int, vocab: Vocab | None = None,
              n_ctx_slot: int | None = None, n_adapters: int = 0,
              reasoning: ReasoningParams | None = None) -> ChatCompletionRequest:
        messages = chat_messages(body)
        check_chat_bytes(messages, vocab, n_ctx_slot)
        gen = gen_params(body, chat=True, n_slots=n_slots, n_vocab=n_vocab, n_adapters=n_adapters)
        chat = chat_options(body, reasoning or ReasoningParams(), _response_schema(body))
        if chat.calls_tools:
            if body.get("grammar") is not None:
                raise bad("grammar", "'grammar' cannot be combined with 'tools': the tools' schemas constrain "
                                     "the reply (response_format gives the answer's)")
            gen = dataclasses.replace(gen, constraint=None)      # the answer's schema is part of the tools' grammar
        stream, include_usage = stream_fields(body)
        return cls(messages, gen, stream, include_usage, _bool(body, "cache_prompt", False), chat, media_parts(body))


@dataclass(frozen=True)
class CompletionRequest:
    """POST /v1/completions: one job per prompt. Tokenizes: parse it off the event loop."""

    prompts: list[list[int]]
    params: GenParams
    stream: bool
    include_usage: bool
    cache_prompt: bool

    @classmethod
    def parse(cls, body: dict, tokenize: Tokenize, *, n_slots: int, n_vocab: int, vocab: Vocab | None = None,
              n_ctx_slot: int | None = None, n_adapters: int = 0) -> CompletionRequest:
        params = gen_params(body, chat=False, n_slots=n_slots, n_vocab=n_vocab, n_adapters=n_adapters)
        stream, include_usage = stream_fields(body)
        prompts = completion_prompts(body, tokenize, vocab=vocab, n_ctx_slot=n_ctx_slot)
        return cls(prompts, params, stream, include_usage, _bool(body, "cache_prompt", False))


@dataclass(frozen=True)
class EmbeddingRequest:
    """POST /v1/embeddings. Tokenizes: parse it off the event loop."""

    inputs: list[list[int]]
    encoding_format: str        # "float" or "base64"

    @classmethod
    def parse(cls, body: dict, tokenize: Tokenize, *, n_vocab: int, vocab: Vocab | None = None,
              max_input_tokens: int | None = None) -> EmbeddingRequest:
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise bad("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {json.dumps(fmt)[:50]}")
        return cls(embedding_inputs(body, tokenize, n_vocab, vocab=vocab, max_input_tokens=max_input_tokens), fmt)


@dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize (llama-server's)."""

    content: str
    add_special: bool
    with_pieces: bool

    @classmethod
    def parse(cls, body: dict) -> TokenizeRequest:
        content = body.get("content")
        if not isinstance(content, str):
            raise bad("content", "'content' must be a string")
        return cls(content, _bool(body, "add_special", False), _bool(body, "with_pieces", False))


@dataclass(frozen=True)
class DetokenizeRequest:
    """POST /detokenize (llama-server's)."""

    tokens: list[int]

    @classmethod
    def parse(cls, body: dict, *, n_vocab: int) -> DetokenizeRequest:
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t < n_vocab for t in toks):
            raise bad("tokens", f"'tokens' must be a list of token ids in [0, {n_vocab})")
        return cls(toks)
