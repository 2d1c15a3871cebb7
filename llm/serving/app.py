"""An OpenAI-compatible HTTP server (`python -m llm serve`) on FastAPI + uvicorn.

Routes: POST /v1/chat/completions and /v1/completions (SSE with `stream: true`; a
`response_format` constrains the output to JSON or a JSON schema), POST /v1/embeddings, GET
/v1/models, GET /health, GET /slots, POST /slots/{id}?action=save|restore (with
--slot-save-path), POST /tokenize and /detokenize (as llama-server has them). Requests go to
an `llm.serving.Engine`, which batches all running requests in one thread; the handlers wait
on an asyncio queue fed from that thread. Slot save/restore runs on that thread too.

Bad input gets an OpenAI-style error object {"error": {"message", "type", "param", "code"}}:
400 for malformed or invalid fields, 401 without the API key, 404 for an unknown slot, 409
for a busy one, 413 for a body over 8 MiB, 503 with Retry-After when the queue is full, 500
when the engine fails inside a request (only that request; the engine keeps serving the others).
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llm.chat.templates import ChatTemplateError
from llm.errors import GrammarError, StateError
from llm.sampling import structured as grammar_mod
from llm.sampling.samplers import LLAMA_DEFAULT_SEED, SamplingParams
from llm.serving.batcher import (
    FINISH_EOG,
    MAX_TOP_LOGPROBS,
    Delta,
    Done,
    Engine,
    Failed,
    GenParams,
    Job,
    QueueFull,
    SlotBusy,
    SlotNotFound,
)
from llm.state import slot_path

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
MAX_STOP = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---- request fields ----------------------------------------------------------------------

def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer, got {json.dumps(v)[:50]}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(name, f"'{name}' must be {rng}, got {v}")
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"'{name}' must be a number, got {json.dumps(v)[:50]}")
    if not lo <= v <= hi:
        raise _bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {json.dumps(v)[:50]}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"'stop' has {len(stops)} strings; at most {MAX_STOP}")
    return [s for s in stops if s]


def _logit_bias(body: dict, n_vocab: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except ValueError:
            raise _bad("logit_bias", f"'logit_bias' key {k!r} is not a token id") from None
        if not 0 <= tok < n_vocab:
            raise _bad("logit_bias", f"'logit_bias' token {tok} is out of range [0, {n_vocab})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100]")
        out[tok] = float(b)
    return out


def gen_params(body: dict, *, chat: bool, n_slots: int, n_vocab: int) -> GenParams:
    """GenParams from the OpenAI fields (with llama.cpp's top_k, min_p, repeat_penalty)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None if chat else 16, lo=1)
    seed = _int(body, "seed", None)
    n = _int(body, "n", 1, lo=1)
    if n > n_slots:
        raise _bad("n", f"'n' = {n} is more than the server's {n_slots} slots")
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    else:
        top = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        logprobs = top is not None
        top = top or 0
    sampling = SamplingParams(
        seed=LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF,
        temp=_num(body, "temperature", 0.8, 0.0, 2.0),
        top_p=_num(body, "top_p", 0.95, 0.0, 1.0),
        top_k=_int(body, "top_k", 40, lo=0),
        min_p=_num(body, "min_p", 0.05, 0.0, 1.0),
        penalty_repeat=_num(body, "repeat_penalty", 1.0, 0.0, 10.0),
        penalty_freq=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        penalty_present=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, n_vocab))
    try:
        constraint = grammar_mod.spec_response_format(body.get("response_format"))
    except GrammarError as e:
        raise _bad("response_format", f"'response_format' is invalid: {e}") from None
    return GenParams(max_tokens=max_tokens, sampling=sampling, stop=_stop(body), n=n, logprobs=logprobs,
                     top_logprobs=top, constraint=constraint)


def embedding_inputs(body: dict, tokenize, n_vocab: int) -> list[list[int]]:
    """`input` as a string, a list of token ids, or a list of strings / token lists."""
    v = body.get("input")
    err = _bad("input", "'input' must be a non-empty string, a list of token ids, or a list of those")
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise err
    if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        v = [v]
    out = []
    for x in v:
        if isinstance(x, str) and x:
            out.append(tokenize(x))
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            if not all(0 <= t < n_vocab for t in x):
                raise _bad("input", f"'input' token ids must be in [0, {n_vocab})")
            out.append(list(x))
        else:
            raise err
    return out


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                              f"got {json.dumps(role)[:50]}")
        if isinstance(content, list):   # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", f"messages[{i}].content parts must be "
                                                     "{\"type\": \"text\", \"text\": string}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def completion_prompts(body: dict, tokenize) -> list[list[int]]:
    """`prompt` as a string, a list of token ids, or a list of either (one job each)."""
    p = body.get("prompt")
    err = _bad("prompt", "'prompt' must be a string, a list of token ids, or a list of strings / token lists")
    if isinstance(p, str):
        return [tokenize(p)]
    if not isinstance(p, list) or not p:
        raise err
    if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [list(p)]
    out = []
    for x in p:
        if isinstance(x, str):
            out.append(tokenize(x))
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            out.append(list(x))
        else:
            raise err
    return out


async def read_json(request: Request) -> dict:
    """The JSON object in the body; 413 past MAX_BODY_BYTES, 400 when it is not JSON."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {size} bytes is over the {MAX_BODY_BYTES} byte limit",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is over the {MAX_BODY_BYTES} byte limit", code="request_too_large")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    return obj


# ---- running jobs -------------------------------------------------------------------------

class Run:
    """The jobs of one HTTP request (one per prompt), their events merged into one queue."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: GenParams, cache_prompt: bool = False):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.jobs = [Job(toks, params, self._sink(k), cache_prompt=cache_prompt) for k, toks in enumerate(prompts)]
        self.n = params.n
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    def _sink(self, k: int):
        def put(ev) -> None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (k, ev))
        return put

    def submit(self) -> None:
        try:
            for job in self.jobs:
                self.engine.submit(job)
        except QueueFull as e:
            self.cancel()
            raise APIError(503, f"server busy: {e}", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except ValueError as e:
            self.cancel()
            raise APIError(400, str(e), param="prompt") from None

    def cancel(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.engine.cancel(job)

    async def next(self, request: Request, poll: bool = True) -> tuple[int, object]:
        """The next event. With poll, check every second whether the client went away (then
        cancel); a streaming response must not poll (Starlette's own disconnect listener reads
        the same channel, and it closes the stream on a disconnect, which cancels the jobs)."""
        while True:
            try:
                k, ev = await (asyncio.wait_for(self.events.get(), 1.0) if poll else self.events.get())
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise asyncio.CancelledError("client disconnected") from None
                continue
            if isinstance(ev, Delta) and self.t_first is None:
                self.t_first = time.perf_counter()
            return k, ev


def _finish_reason(reason: str) -> str:
    return "stop" if reason == FINISH_EOG else reason


def _piece(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(lps, vocab) -> list[dict]:
    out = []
    for lp in lps:
        tops = [{"token": _piece(vocab.token_to_piece(t)), "logprob": v, "bytes": list(vocab.token_to_piece(t))}
                for t, v in lp.top]
        out.append({"token": _piece(lp.piece), "logprob": lp.logprob, "bytes": list(lp.piece), "top_logprobs": tops})
    return out


def text_logprobs(lps, vocab, offset0: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for lp in lps:
        s = _piece(lp.piece)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_piece(vocab.token_to_piece(t)): v for t, v in lp.top})
        out["text_offset"].append(off)
        off += len(s)
    return out


# ---- the app ------------------------------------------------------------------------------

def create_app(llm, engine: Engine, *, model_name: str, aliases: tuple[str, ...] = (),
               api_key: str | None = None, slot_save_path: str | Path | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (an llm.LLM, for the vocab, chat template and embeddings)
    through `engine` (running on llm.ctx). Slots are saved to and restored from files in
    `slot_save_path`."""
    app = FastAPI(title="ggmlx llm server")
    names = {model_name, *aliases}
    vocab = llm.vocab
    n_slots = engine.batcher.n_slots
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal server error: {type(e).__name__}", type="server_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                code="invalid_api_key").response()
        return await call_next(request)

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise _bad("model", "'model' must be a string")
        if m not in names:
            raise APIError(400, f"the model '{m}' does not exist; this server has '{model_name}'",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        snap = engine.snapshot
        return {"status": "ok", **{k: v for k, v in snap.items() if k != "slots"}}

    @app.get("/slots")
    async def slots():
        return engine.snapshot["slots"]

    @app.post("/slots/{slot}")
    async def slot_action(slot: str, request: Request, action: str = ""):
        if not slot.isdigit():
            raise APIError(404, f"slot {slot!r} does not exist", param="id_slot", code="slot_not_found")
        slot_id = int(slot)
        if action not in ("save", "restore"):
            raise _bad("action", f"'action' must be 'save' or 'restore', got {action!r}")
        if slot_save_path is None:
            raise APIError(400, "slot save/restore is off: start the server with --slot-save-path DIR",
                           code="not_supported")
        body = await read_json(request)
        filename = body.get("filename")
        try:
            path = slot_path(slot_save_path, filename)      # type: ignore[arg-type]
        except StateError as e:
            raise _bad("filename", str(e)) from None
        t0 = time.perf_counter()
        try:
            if action == "save":
                n = await run_in_threadpool(engine.call, lambda b: b.save_slot(slot_id, path))
            else:
                n = await run_in_threadpool(engine.call, lambda b: b.restore_slot(slot_id, path))
        except SlotNotFound as e:
            raise APIError(404, str(e), param="id_slot", code="slot_not_found") from None
        except SlotBusy as e:
            raise APIError(409, str(e), param="id_slot", code="slot_busy") from None
        except (StateError, OSError) as e:
            raise _bad("filename", f"{action} failed: {e}") from None
        ms = (time.perf_counter() - t0) * 1000
        key = "n_saved" if action == "save" else "n_restored"
        return {"id_slot": slot_id, "filename": filename, key: n,
                "timings": {("save_ms" if action == "save" else "restore_ms"): ms}}

    embed_lock = threading.Lock()     # LLM.embed builds its context on first use

    def embed(tokens: list[list[int]]) -> np.ndarray:
        with embed_lock:
            return llm.embed(tokens, normalize=True)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_json(request)
        check_model(body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _bad("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {json.dumps(fmt)[:50]}")
        inputs = await run_in_threadpool(embedding_inputs, body, lambda s: vocab.tokenize(s, True, True),
                                         vocab.n_tokens)
        try:
            vecs = await run_in_threadpool(embed, inputs)
        except ValueError as e:
            raise _bad("input", str(e)) from None
        data = []
        for i, v in enumerate(vecs):
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n_tok = sum(map(len, inputs))
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "ggmlx"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise _bad("content", "'content' must be a string")
        add_special = _bool(body, "add_special", False)
        toks = await run_in_threadpool(vocab.tokenize, content, add_special, True)
        if _bool(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": _piece(vocab.token_to_piece(t, special=True))} for t in toks]}
        return {"tokens": toks}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t < vocab.n_tokens for t in toks):
            raise _bad("tokens", f"'tokens' must be a list of token ids in [0, {vocab.n_tokens})")
        return {"content": vocab.detokenize(toks)}

    async def start(request: Request, prompts: list[list[int]], params: GenParams,
                    cache_prompt: bool) -> tuple[Run, list]:
        """Submit the jobs and wait for the first event, so failures before the first token
        still get a proper status."""
        run = Run(engine, prompts, params, cache_prompt)
        run.submit()
        first = await run.next(request)
        if isinstance(first[1], Failed):
            run.cancel()
            raise APIError(500, f"generation failed: {first[1].message}", type="server_error")
        return run, [first]

    def log_done(path: str, run: Run, n_prompt: int, n_gen: int, reasons) -> None:
        t = time.perf_counter() - run.t0
        ttft = (run.t_first - run.t0) if run.t_first else t
        log.info("%s: %d prompt + %d generated tokens in %.2f s (first token %.2f s, %.1f tok/s), finish %s",
                 path, n_prompt, n_gen, t, ttft, n_gen / max(t - ttft, 1e-9) if n_gen > 1 else 0.0,
                 ",".join(reasons))

    async def generate(request: Request, prompts: list[list[int]], params: GenParams, *, chat: bool,
                       stream: bool, include_usage: bool, cache_prompt: bool):
        n_choices = len(prompts) * params.n
        run, pending = await start(request, prompts, params, cache_prompt)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        texts = [""] * n_choices
        lps: list[list] = [[] for _ in range(n_choices)]
        reasons: list[str | None] = [None] * n_choices
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        n_left = len(prompts)

        def handle(k: int, ev):
            """Apply one event; returns a stream chunk (or None)."""
            nonlocal n_left
            if isinstance(ev, Failed):
                raise APIError(500, f"generation failed: {ev.message}", type="server_error")
            if isinstance(ev, Done):
                usage["prompt_tokens"] += ev.n_prompt_tokens
                usage["completion_tokens"] += ev.n_completion_tokens
                n_left -= 1
                return None
            i = k * params.n + ev.index
            offset = len(texts[i])
            texts[i] += ev.text
            lps[i] += ev.logprobs
            if ev.finish_reason is not None:
                reasons[i] = _finish_reason(ev.finish_reason)
            if not stream or (not ev.text and not ev.logprobs and ev.finish_reason is None):
                return None
            if chat:
                choice = {"index": i, "delta": {"content": ev.text} if ev.text else {},
                          "logprobs": {"content": chat_logprobs(ev.logprobs, vocab)} if params.logprobs else None,
                          "finish_reason": reasons[i]}
            else:
                choice = {"index": i, "text": ev.text,
                          "logprobs": text_logprobs(ev.logprobs, vocab, offset) if params.logprobs else None,
                          "finish_reason": reasons[i]}
            return {**base, "choices": [choice]}

        def usage_obj():
            return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

        if not stream:
            try:
                for k, ev in pending:
                    handle(k, ev)
                while n_left:
                    handle(*await run.next(request))
            except BaseException:
                run.cancel()
                raise
            log_done(request.url.path, run, usage["prompt_tokens"], usage["completion_tokens"], reasons)
            if chat:
                choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                            "logprobs": {"content": chat_logprobs(lps[i], vocab)} if params.logprobs else None,
                            "finish_reason": reasons[i]} for i in range(n_choices)]
            else:
                choices = [{"index": i, "text": texts[i],
                            "logprobs": text_logprobs(lps[i], vocab, 0) if params.logprobs else None,
                            "finish_reason": reasons[i]} for i in range(n_choices)]
            return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion",
                                 "choices": choices, "usage": usage_obj()})

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            try:
                if chat:
                    for i in range(n_choices):
                        yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                queue = list(pending)
                while n_left:
                    k, ev = queue.pop(0) if queue else await run.next(request, poll=False)
                    try:
                        chunk = handle(k, ev)
                    except APIError as e:
                        yield sse({"error": {"message": e.message, "type": e.type, "param": None, "code": None}})
                        return
                    if chunk is not None:
                        yield sse(chunk)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage_obj()})
                yield "data: [DONE]\n\n"
                log_done(request.url.path, run, usage["prompt_tokens"], usage["completion_tokens"], reasons)
            finally:
                run.cancel()    # a client that went away: free its slots at once

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_fields(body: dict) -> tuple[bool, bool]:
        stream = _bool(body, "stream", False)
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        include_usage = _bool(opts or {}, "include_usage", False)
        return stream, include_usage

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        check_model(body)
        messages = chat_messages(body)
        params = gen_params(body, chat=True, n_slots=n_slots, n_vocab=vocab.n_tokens)
        stream, include_usage = stream_fields(body)
        try:
            tokens = await run_in_threadpool(llm.chat_tokens, messages)
        except ChatTemplateError as e:
            raise _bad("messages", f"the chat template failed for these messages: {e}") from None
        if len(tokens) >= engine.batcher.n_ctx_slot:
            raise APIError(400, f"the prompt has {len(tokens)} tokens; a slot holds {engine.batcher.n_ctx_slot}",
                           param="messages", code="context_length_exceeded")
        return await generate(request, [tokens], params, chat=True, stream=stream, include_usage=include_usage,
                              cache_prompt=_bool(body, "cache_prompt", False))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_model(body)
        params = gen_params(body, chat=False, n_slots=n_slots, n_vocab=vocab.n_tokens)
        stream, include_usage = stream_fields(body)
        prompts = await run_in_threadpool(completion_prompts, body, lambda s: vocab.tokenize(s, True, True))
        for p in prompts:
            if len(p) >= engine.batcher.n_ctx_slot:
                raise APIError(400, f"the prompt has {len(p)} tokens; a slot holds {engine.batcher.n_ctx_slot}",
                               param="prompt", code="context_length_exceeded")
        return await generate(request, prompts, params, chat=False, stream=stream, include_usage=include_usage,
                              cache_prompt=_bool(body, "cache_prompt", False))

    return app


def model_name_of(path: str | Path) -> str:
    return Path(path).name.removesuffix(".gguf")
