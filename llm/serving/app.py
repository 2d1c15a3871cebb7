"""An OpenAI-compatible HTTP server (`python -m llm serve`) on FastAPI + uvicorn.

Routes: POST /v1/chat/completions and /v1/completions (SSE with `stream: true`; a
`response_format` constrains the output to JSON or a JSON schema; chat image_url parts with
--mmproj: llm.serving.media), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API: llm.serving.anthropic), POST /infill and
/rerank (llama-server's own: llm.serving.native), POST /v1/embeddings, GET
/v1/models, GET /health, GET /slots, POST /slots/{id}?action=save|restore (with
--slot-save-path), POST /tokenize and /detokenize, GET /props and /metrics (with --metrics;
llm.serving.info) as llama-server has them, and the chat page at / (llm.serving.webui; off
with --no-webui). Requests go to
an `llm.serving.Engine`, which batches all running requests in one thread; the handlers wait
on an asyncio queue fed from that thread. Slot save/restore runs on that thread too.

This module only builds the app; the handlers are llm.serving.routes (one function per
route, docs/adding-a-route.md), request bodies are parsed by llm.serving.requests, responses
are written by llm.serving.completions and streamed by llm.serving.sse.

Bad input gets an OpenAI-style error object {"error": {"message", "type", "param", "code"}}:
400 for malformed or invalid fields, 401 without the API key, 404 for an unknown slot, 409
for a busy one, 408 for a body that stops arriving (serve --timeout), 413 for a body over 8 MiB,
503 with Retry-After when the queue is full, 500 when the engine fails inside a request (only
that request; the engine keeps serving the others). Error messages show no absolute paths.
Under /v1/messages the same errors are in Anthropic's shape ({"type": "error", "error": {"type",
"message"}}). A connection whose request head does not arrive in time is closed (llm.serving.protocol).
"""
from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from llm.params import MediaParams, ReasoningParams, ServerEndpoints, ServerTimeouts
from llm.serving import anthropic, info, native, webui
from llm.serving.completions import Run, chat_logprobs, text_logprobs
from llm.serving.engine import Engine
from llm.serving.requests import (
    CHAT_ROLES,
    MAX_BODY_BYTES,
    MAX_STOP,
    APIError,
    chat_messages,
    completion_prompts,
    embedding_inputs,
    gen_params,
    max_token_bytes,
    read_json,
)
from llm.serving.routes import ServerState, router

if TYPE_CHECKING:
    from llm.api import LLM

# the names this module had when it held the handlers (llm.server is its old path)
__all__ = ["CHAT_ROLES", "MAX_BODY_BYTES", "MAX_STOP", "APIError", "Run", "ServerState", "chat_logprobs",
           "chat_messages", "completion_prompts", "create_app", "embedding_inputs", "gen_params",
           "model_name_of", "read_json", "text_logprobs"]

log = logging.getLogger(__name__)


async def api_error(request: Request, e: APIError):
    if anthropic.is_anthropic(request.url.path):
        return anthropic.error_response(e)
    return e.response()


async def http_error(request: Request, e: StarletteHTTPException):
    """Starlette's own errors (no such route: 404, wrong method: 405) in the API's error shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    message = (f"no route {request.method} {request.url.path}" if e.status_code in (404, 405)
               else str(e.detail))
    return await api_error(request, APIError(e.status_code, message, code=code, headers=dict(e.headers or {})))


async def internal_error(request: Request, e: Exception):
    log.exception("internal error on %s", request.url.path)
    return await api_error(request, APIError(500, f"internal server error: {type(e).__name__}", type="server_error"))


class APIKeyMiddleware:
    """With an API key set, every route but the `public` ones (/health, the chat page's files)
    needs `Authorization: Bearer KEY` or, as Anthropic's clients send it, `X-Api-Key: KEY`
    (llama-server takes both). A plain ASGI middleware: Starlette's BaseHTTPMiddleware
    would hide a client's disconnect from the handlers, so a non-streaming request whose client
    left would run on to max_tokens."""

    def __init__(self, app, api_key: str | None, public: tuple[str, ...] = ("/health",)):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.key = None if api_key is None else api_key.encode()
        self.public = frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.public:
            headers = dict(scope["headers"])
            assert self.key is not None
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                e = APIError(401, "invalid or missing API key (Authorization: Bearer ... or X-Api-Key)",
                             code="invalid_api_key")
                response = anthropic.error_response(e) if anthropic.is_anthropic(scope["path"]) else e.response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: LLM, engine: Engine, *, model_name: str, aliases: tuple[str, ...] = (),
               api_key: str | None = None, slot_save_path: str | Path | None = None,
               special_in_content: bool = False, timeouts: ServerTimeouts | None = None,
               endpoints: ServerEndpoints | None = None, reasoning: ReasoningParams | None = None,
               media: MediaParams | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (an llm.LLM, for the vocab, chat template and embeddings)
    through `engine` (running on llm.ctx). Slots are saved to and restored from files in
    `slot_save_path`. The routes (llm.serving.routes) find all of this in app.state.server; a
    request body that goes `timeouts.timeout` seconds without data is a 408 (default:
    ServerTimeouts(); the header timeout is the HTTP protocol's, llm.serving.protocol).
    `endpoints` turns /metrics and the chat page on or off (default: ServerEndpoints()); `reasoning`
    says where chat replies' thinking goes and whether there is any (default: ReasoningParams()).
    Images in chat requests need `llm` loaded with an mmproj and `engine` made with its
    MtmdContext; `media.allow_remote_media` lets their URLs be http(s) (default: MediaParams())."""
    app = FastAPI(title="ggmlx llm server", exception_handlers={APIError: api_error, StarletteHTTPException: http_error,
                                                                       Exception: internal_error})
    app.state.body_timeout = (timeouts or ServerTimeouts()).timeout
    app.state.endpoints = endpoints = endpoints or ServerEndpoints()
    max_token_bytes(llm.vocab)      # computed once here, not on the event loop by the first request
    app.state.server = ServerState(llm=llm, engine=engine, model_name=model_name, aliases=tuple(aliases),
                                   api_key=api_key, slot_save_path=slot_save_path,
                                   special_in_content=special_in_content, reasoning=reasoning or ReasoningParams(),
                                   reranking=endpoints.reranking,
                                   allow_remote_media=(media or MediaParams()).allow_remote_media)
    app.add_middleware(APIKeyMiddleware, api_key=api_key,
                       public=("/health", *webui.PAGES) if endpoints.webui else ("/health",))
    app.include_router(router)
    app.include_router(info.router)
    app.include_router(anthropic.router)
    app.include_router(native.router)
    if endpoints.webui:
        app.include_router(webui.router)
    return app


def model_name_of(path: str | Path) -> str:
    return Path(path).name.removesuffix(".gguf")
