"""The HTTP routes, one module-level handler each, on one APIRouter.

A handler reaches the model, the engine and the server's settings through
`request.app.state.server` (a ServerState, set by create_app), parses its body into a
dataclass from llm.serving.requests, and raises APIError for anything it answers with an
error. Work on the Context goes to the engine thread: `engine.call(fn)` for one-off calls
(slot save/restore), a Run of Jobs for generation. docs/adding-a-route.md says how to add one.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from llm.api import EmbedAborted
from llm.chat.formats import ChatSyntax
from llm.chat.prompt import ChatOptions, ChatPrompt
from llm.chat.templates import ChatTemplateError
from llm.errors import GrammarError, StateError
from llm.generation.batcher import SlotBusy, SlotNotFound
from llm.generation.core import GenParams
from llm.params import ReasoningParams
from llm.serving.completions import Choices, Run, chunks, collect, piece
from llm.serving.engine import Engine
from llm.serving.media import load_images, media_job
from llm.serving.requests import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    bad,
    check_model,
    lora_scales,
    read_json,
    read_json_list,
)
from llm.serving.sse import sse_response
from llm.state import slot_path

if TYPE_CHECKING:
    from llm.api import LLM
    from llm.mtmd import InputChunk

log = logging.getLogger(__name__)

router = APIRouter()


@dataclass(frozen=True)
class ServerState:
    """What the routes share: `llm` (an llm.LLM: vocab, chat template, embeddings), the
    `engine` running on llm.ctx, the model's names, the API key and the slot file directory."""

    llm: LLM
    engine: Engine
    model_name: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    slot_save_path: str | Path | None = None
    special_in_content: bool = False      # parse control tokens spelled in message content (--special-in-content)
    reasoning: ReasoningParams = ReasoningParams()     # --reasoning-format, --reasoning-budget
    reranking: bool = False       # --reranking: /rerank on a model with a classifier head whose pooling is not rank
    allow_remote_media: bool = False      # --allow-remote-media: image_url parts may be http(s) URLs
    created: int = field(default_factory=lambda: int(time.time()))
    embed_lock: threading.Lock = field(default_factory=threading.Lock)   # LLM.embed builds its context on first use

    @property
    def vocab(self):
        return self.llm.vocab

    def check_model(self, body: dict) -> None:
        check_model(body, {self.model_name, *self.aliases}, self.model_name)

    def tokenize(self, text: str) -> list[int]:
        """A prompt's tokens (special tokens added and parsed)."""
        return self.vocab.tokenize(text, True, True)

    def embed(self, tokens: list[list[int]], gone: threading.Event) -> np.ndarray:
        """Embeddings of the inputs, stopped (EmbedAborted) between batches once `gone` is set."""
        with self.embed_lock:
            return self.llm.embed(tokens, normalize=True, abort_callback=gone.is_set)


def server_of(request: Request) -> ServerState:
    return request.app.state.server


# ---- server state and slots --------------------------------------------------------------

@router.get("/health")
async def health(request: Request):
    snap = server_of(request).engine.snapshot
    return {"status": "ok", **{k: v for k, v in snap.items() if k != "slots"}}


@router.get("/slots")
async def slots(request: Request):
    return server_of(request).engine.snapshot["slots"]


@router.post("/slots/{slot}")
async def slot_action(slot: str, request: Request, action: str = ""):
    """llama-server's slot save/restore: the slot's cells to or from a file in --slot-save-path."""
    server = server_of(request)
    if not (slot.isascii() and slot.isdigit() and len(slot) <= 9):       # '²'.isdigit(); int() of 5,000 digits
        raise APIError(404, f"slot {slot!r} does not exist", param="id_slot", code="slot_not_found")
    slot_id = int(slot)
    if action not in ("save", "restore"):
        raise bad("action", f"'action' must be 'save' or 'restore', got {action!r}")
    if server.slot_save_path is None:
        raise APIError(400, "slot save/restore is off: start the server with --slot-save-path DIR",
                       code="not_supported")
    body = await read_json(request)
    filename = body.get("filename")
    try:
        path = slot_path(server.slot_save_path, filename)      # type: ignore[arg-type]
    except StateError as e:
        raise bad("filename", str(e)) from None
    t0 = time.perf_counter()
    try:
        if action == "save":
            n = await run_in_threadpool(server.engine.call, lambda b: b.save_slot(slot_id, path))
        else:
            n = await run_in_threadpool(server.engine.call, lambda b: b.restore_slot(slot_id, path))
    except SlotNotFound as e:
        raise APIError(404, str(e), param="id_slot", code="slot_not_found") from None
    except SlotBusy as e:
        raise APIError(409, str(e), param="id_slot", code="slot_busy") from None
    except (StateError, OSError) as e:
        raise bad("filename", f"{action} failed: {e}") from None
    ms = (time.perf_counter() - t0) * 1000
    key = "n_saved" if action == "save" else "n_restored"
    return {"id_slot": slot_id, "filename": filename, key: n,
            "timings": {("save_ms" if action == "save" else "restore_ms"): ms}}


# ---- LoRA adapters -----------------------------------------------------------------------

def adapter_list(server: ServerState) -> list[dict]:
    """llama-server's GET /lora-adapters entries: id, file name, the scale every request without
    its own `lora` uses, and the adapter's task name / prompt prefix when its metadata has them."""
    lora = server.engine.batcher.ctx.lora
    out = []
    for i, (a, scale) in enumerate(zip(server.llm.adapters, lora.scales, strict=True)):
        entry: dict = {"id": i, "path": Path(a.path).name, "scale": scale}
        for key in ("task_name", "prompt_prefix"):
            v = a.meta_val_str(f"adapter.lora.{key}")
            if v is not None:
                entry[key] = v
        out.append(entry)
    return out


@router.get("/lora-adapters")
async def lora_adapters(request: Request):
    return adapter_list(server_of(request))


@router.post("/lora-adapters")
async def set_lora_adapters(request: Request):
    """Set the scales every request without its own `lora` uses: [{"id": 0, "scale": 0.5}, ...];
    an adapter not listed gets 0, as in llama-server. Runs on the engine thread between steps;
    the slots' cached prompts were computed under the old scales and are dropped."""
    server = server_of(request)
    scales = lora_scales(await read_json_list(request), len(server.llm.adapters), field="body")
    adapters = list(server.llm.adapters)
    await run_in_threadpool(server.engine.call, lambda b: b.set_adapters_lora(adapters, scales))
    return {"success": True}


# ---- models, embeddings, tokens ----------------------------------------------------------

@router.get("/v1/models")
async def models(request: Request):
    server = server_of(request)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "ggmlx"}]}


async def watch_disconnect(request: Request, gone: threading.Event, every: float = 0.5) -> None:
    """Set `gone` when the client of a non-streaming request hangs up (polled every `every` s)."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)
    gone.set()


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    server = server_of(request)
    body = await read_json(request)
    server.check_model(body)
    req = await run_in_threadpool(EmbeddingRequest.parse, body, server.tokenize, n_vocab=server.vocab.n_tokens,
                                  vocab=server.vocab,
                                  max_input_tokens=min(server.llm.ctx.n_ubatch, server.llm.ctx.n_ctx))
    gone = threading.Event()
    watch = asyncio.create_task(watch_disconnect(request, gone))
    try:
        vecs = await run_in_threadpool(server.embed, req.inputs, gone)
    except EmbedAborted:
        log.info("/v1/embeddings: the client left; stopped after a batch")
        raise asyncio.CancelledError("client disconnected") from None
    except ValueError as e:
        raise bad("input", str(e)) from None
    finally:
        watch.cancel()
    data = []
    for i, v in enumerate(vecs):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n_tok = sum(map(len, req.inputs))
    return {"object": "list", "data": data, "model": server.model_name,
            "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}}


@router.post("/tokenize")
async def tokenize(request: Request):
    vocab = server_of(request).vocab
    req = TokenizeRequest.parse(await read_json(request))
    toks = await run_in_threadpool(vocab.tokenize, req.content, req.add_special, True)
    if req.with_pieces:
        return {"tokens": [{"id": t, "piece": piece(vocab.token_to_piece(t, special=True))} for t in toks]}
    return {"tokens": toks}


@router.post("/detokenize")
async def detokenize(request: Request):
    vocab = server_of(request).vocab
    req = DetokenizeRequest.parse(await read_json(request), n_vocab=vocab.n_tokens)
    return {"content": vocab.detokenize(req.tokens)}


# ---- generation --------------------------------------------------------------------------

def check_prompt_length(server: ServerState, tokens: list[int], param: str) -> None:
    n_ctx_slot = server.engine.batcher.n_ctx_slot
    if len(tokens) >= n_ctx_slot:
        raise APIError(400, f"the prompt has {len(tokens)} tokens; a slot holds {n_ctx_slot}",
                       param=param, code="context_length_exceeded")


async def chat_prompt_tokens(server: ServerState, messages: list[dict],
                             options: ChatOptions) -> tuple[ChatPrompt, list[int]]:
    """The chat prompt of `messages` (its grammar and reply syntax) and its tokens, made off the
    event loop; a template or tools' grammar that fails is a 400."""
    try:
        return await run_in_threadpool(functools.partial(server.llm.chat_prompt, messages, options,
                                                         special_in_content=server.special_in_content))
    except ChatTemplateError as e:
        raise bad("messages", f"the chat template failed for these messages: {e}") from None
    except GrammarError as e:
        raise bad("tools", f"the tools cannot be turned into a grammar: {e}") from None


async def generate(request: Request, server: ServerState, prompts: list[list[int]], params: GenParams, *,
                   syntax: ChatSyntax | None, stream: bool, include_usage: bool, cache_prompt: bool,
                   media: dict[int, InputChunk] | None = None):
    """Run one job per prompt; the completion as one JSON object, or streamed as SSE. A chat
    completion's replies are read back with `syntax`; `media`: the one prompt's images."""
    run = Run(server.engine, prompts, params, cache_prompt, prompt_field="prompt" if syntax is None else "messages",
              media=media)
    pending = await run.start(request)
    choices = Choices(len(prompts), params, syntax=syntax, stream=stream, vocab=server.vocab,
                      model_name=server.model_name)
    if stream:
        return sse_response(chunks(request, run, choices, pending, include_usage), run.cancel)
    return JSONResponse(await collect(request, run, choices, pending))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    server = server_of(request)
    body = await read_json(request)
    server.check_model(body)
    req = ChatCompletionRequest.parse(body, n_slots=server.engine.batcher.n_slots, n_vocab=server.vocab.n_tokens,
                                      vocab=server.vocab, n_ctx_slot=server.engine.batcher.n_ctx_slot,
                                      n_adapters=len(server.llm.adapters), reasoning=server.reasoning)
    if req.media and server.llm.mtmd is None:
        where = req.media[0].where
        raise bad(where, f"{where}: this server reads no images (it runs without --mmproj, the model's vision "
                         "projector)")
    bitmaps = await run_in_threadpool(load_images, req.media, server.allow_remote_media) if req.media else []
    chat, tokens = await chat_prompt_tokens(server, req.messages, req.chat)
    media = None
    if req.media:
        tokens, media = await run_in_threadpool(media_job, server.llm, chat.prompt, req.media, bitmaps,
                                                server.engine.batcher.n_ctx_slot)
    check_prompt_length(server, tokens, "messages")
    params = dataclasses.replace(req.params, constraint=chat.grammar or req.params.constraint,
                                 preserved_tokens=chat.preserved_tokens)
    return await generate(request, server, [tokens], params, syntax=chat.syntax, stream=req.stream,
                          include_usage=req.include_usage, cache_prompt=req.cache_prompt, media=media)


@router.post("/v1/completions")
async def completions(request: Request):
    server = server_of(request)
    body = await read_json(request)
    server.check_model(body)
    req = await run_in_threadpool(CompletionRequest.parse, body, server.tokenize,
                                  n_slots=server.engine.batcher.n_slots, n_vocab=server.vocab.n_tokens,
                                  vocab=server.vocab, n_ctx_slot=server.engine.batcher.n_ctx_slot,
                                  n_adapters=len(server.llm.adapters))
    for p in req.prompts:
        check_prompt_length(server, p, "prompt")
    return await generate(request, server, req.prompts, req.params, syntax=None, stream=req.stream,
                          include_usage=req.include_usage, cache_prompt=req.cache_prompt)
