"""llama-server's own routes that have no OpenAI counterpart: POST /infill (fill-in-the-middle
code completion) and POST /rerank (with its aliases /reranking, /v1/rerank, /v1/reranking).

/infill takes `input_prefix` and `input_suffix` (required), `input_extra` ([{filename, text}]:
other files of the project) and `prompt` (text the middle starts with), plus the sampling fields
of /completion (n_predict or max_tokens, temperature, top_k, stop, seed, grammar, ...; `stream`).
The prompt is built as llama-server's format_prompt_infill builds it from the vocabulary's FIM
tokens (the repo-level pattern: [FIM_REP]myproject, then [FIM_SEP]filename + text per extra
chunk, then [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]prompt; the prefix keeps its last 3/4 of a
batch, the suffix what is left of the quarter), and a model without FIM prefix, suffix and middle
tokens is a 400. The answer is llama-server's non-OpenAI completion object ({content, tokens,
stop, stop_type, stopping_word, tokens_predicted, tokens_evaluated, tokens_cached, timings,
...}); streamed, one `data: {content, stop: false, ...}` event per piece and a last one with
`stop: true`, no [DONE] (as llama-server streams /completion).

/rerank scores each of `documents` against `query` with the model's classifier head (rank
pooling: BERT-style rerankers' cls / cls.output): the prompt is the model's `rerank` chat
template when its GGUF has one ({query}, {document}), else [BOS] query [EOS] [SEP] document
[EOS] as the vocabulary adds them (llama-server's format_prompt_rerank). The answer is Jina's
shape, {model, object: "list", usage, results: [{index, relevance_score}]} sorted best first
and cut to `top_n`; `return_documents` adds each result's {document: {text}}. A body with
`texts` instead of `documents` is TEI's API: a bare list of {index, score} (with `text` when
`return_text`). A model without a classifier head, or one whose pooling is not rank (unless the
server runs with --reranking), is a 400.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llm.api import EmbedAborted
from llm.generation.batcher import Done, Failed
from llm.generation.core import FINISH_EOG, FINISH_LENGTH, FINISH_STOP, Delta, GenParams
from llm.hparams import PoolingType
from llm.serving.completions import Run, llama_timings, log_done
from llm.serving.requests import APIError, _bool, _int, bad, gen_params, read_json
from llm.serving.routes import ServerState, check_prompt_length, server_of, watch_disconnect
from llm.serving.sse import HEADERS, event
from llm.vocab import LLAMA_TOKEN_NULL, Vocab

router = APIRouter()

# the fields of /completion that are not GenParams' (or are spelled differently there)
_NOT_GEN = ("prompt", "input_prefix", "input_suffix", "input_extra", "n_predict", "max_tokens", "n", "logprobs",
            "top_logprobs", "stream", "stream_options", "cache_prompt", "response_format")
MAX_INFILL_EXTRA = 1024
MAX_RERANK_DOCUMENTS = 2048


# ---- /infill -------------------------------------------------------------------------------

def fim_missing(vocab: Vocab) -> list[str]:
    """The FIM tokens /infill needs that the vocabulary lacks (prefix, suffix, middle)."""
    return [name for name, tok in (("prefix", vocab.fim_pre), ("suffix", vocab.fim_suf), ("middle", vocab.fim_mid))
            if tok == LLAMA_TOKEN_NULL]


def _mixed(v, name: str) -> str | list:
    """A text field of /infill: a string, or a list of token ids and strings (llama-server's
    tokenize_mixed)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in v):
        return v
    raise bad(name, f"'{name}' must be a string (or a list of token ids and strings)")


def _tokens_mixed(vocab: Vocab, v: str | list) -> list[int]:
    """The tokens of a mixed field, its text tokenized without special tokens."""
    parts = [v] if isinstance(v, str) else v
    out: list[int] = []
    for x in parts:
        if isinstance(x, str):
            out += vocab.tokenize(x, False, False)
        else:
            if not 0 <= x < vocab.n_tokens:
                raise ValueError(f"token id {x} is out of range [0, {vocab.n_tokens})")
            out.append(x)
    return out


def infill_prompt(vocab: Vocab, prefix: str | list, suffix: str | list, extra: list[dict], prompt: list[int], *,
                  n_batch: int, n_ctx: int, n_predict: int = -1, spm_infill: bool = False) -> list[int]:
    """The FIM prompt of an infill request, as llama-server's format_prompt_infill makes it."""
    def tok(text: str) -> list[int]:
        return vocab.tokenize(text, False, False)

    extra_tokens: list[int] = []
    if vocab.fim_rep != LLAMA_TOKEN_NULL:
        extra_tokens += [vocab.fim_rep, *tok("myproject\n")]
    for chunk in extra:
        if vocab.fim_sep != LLAMA_TOKEN_NULL:
            extra_tokens += [vocab.fim_sep, *tok(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_tokens += tok("\n\n--- snippet ---\n\n")
        extra_tokens += tok(chunk["text"])
    if vocab.fim_sep != LLAMA_TOKEN_NULL:
        extra_tokens += [vocab.fim_sep, *tok("filename\n")]
    pre, suf = _tokens_mixed(vocab, prefix), _tokens_mixed(vocab, suffix)
    n_pre = min(len(pre), 3 * (n_batch // 4))
    n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    pre = [vocab.fim_pre, *pre[len(pre) - n_pre:], *prompt]
    suf = [vocab.fim_suf, *suf[:n_suf]]
    first, second = (suf, pre) if spm_infill else (pre, suf)
    if vocab.add_bos:
        first = [vocab.bos, *first]
    return [*extra_tokens[len(extra_tokens) - n_extra:], *first, *second, vocab.fim_mid]


@dataclass(frozen=True)
class InfillRequest:
    """POST /infill (llama-server's). Tokenizes: parse it off the event loop."""

    tokens: list[int]
    params: GenParams
    stream: bool
    cache_prompt: bool

    @classmethod
    def parse(cls, body: dict, vocab: Vocab, *, n_slots: int, n_batch: int, n_ctx_slot: int,
              n_adapters: int = 0) -> InfillRequest:
        for name in ("input_prefix", "input_suffix"):
            if name not in body:
                raise bad(name, f"'{name}' is required")
        prefix, suffix = _mixed(body["input_prefix"], "input_prefix"), _mixed(body["input_suffix"], "input_suffix")
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise bad("prompt", "'prompt' must be a string")
        extra = body.get("input_extra", [])
        if not isinstance(extra, list) or len(extra) > MAX_INFILL_EXTRA:
            raise bad("input_extra", "'input_extra' must be a list of {\"filename\": string, \"text\": string} "
                                     f"(at most {MAX_INFILL_EXTRA})")
        for i, chunk in enumerate(extra):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise bad(f"input_extra[{i}].text", f"input_extra[{i}] must have a \"text\" string")
            if chunk.get("filename") is not None and not isinstance(chunk["filename"], str):
                raise bad(f"input_extra[{i}].filename", f"input_extra[{i}].filename must be a string")
        n_predict = _int(body, "n_predict", None, lo=-1)
        if n_predict is None:
            n_predict = _int(body, "max_tokens", -1, lo=-1)
        if n_predict == 0:
            raise bad("n_predict", "'n_predict' must be -1 (until the end of generation) or >= 1")
        gen_body = {k: v for k, v in body.items() if k not in _NOT_GEN}
        gen_body["max_tokens"] = None if n_predict == -1 else n_predict
        params = gen_params(gen_body, chat=True, n_slots=n_slots, n_vocab=vocab.n_tokens, n_adapters=n_adapters)
        try:
            tokens = infill_prompt(vocab, prefix, suffix, [c for c in extra if isinstance(c, dict)],
                                   vocab.tokenize(prompt, False, True), n_batch=n_batch, n_ctx=n_ctx_slot)
        except ValueError as e:
            raise bad("input_prefix", f"'input_prefix' / 'input_suffix': {e}") from None
        return cls(tokens, params, _bool(body, "stream", False), _bool(body, "cache_prompt", False))


STOP_TYPES = {FINISH_EOG: "eos", FINISH_LENGTH: "limit", FINISH_STOP: "word"}


class Completion:
    """One /infill job's events as llama-server's non-OpenAI completion objects."""

    def __init__(self, server: ServerState, n_prompt: int):
        self.model = server.model_name
        self.n_prompt = n_prompt
        self.text = ""
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.stop_word = ""
        self.done: Done | None = None

    def apply(self, ev) -> dict | None:
        """Fold in one event; the stream chunk for a delta with text."""
        if isinstance(ev, Failed):
            raise APIError(500, f"generation failed: {ev.message}", type="server_error")
        if isinstance(ev, Done):
            self.done = ev
            return None
        assert isinstance(ev, Delta)
        self.text += ev.text
        self.tokens += ev.tokens
        if ev.finish_reason is not None:
            self.finish, self.stop_word = ev.finish_reason, ev.stop_word or ""
        if not ev.text:
            return None
        return {"index": 0, "content": ev.text, "tokens": ev.tokens, "stop": False,
                "tokens_predicted": len(self.tokens), "tokens_evaluated": self.n_prompt}

    def final(self, *, stream: bool) -> dict:
        done = self.done
        assert done is not None
        t = done.timings
        n_gen = done.n_completion_tokens
        return {"index": 0, "content": "" if stream else self.text, "tokens": [] if stream else self.tokens,
                "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": n_gen,
                "tokens_evaluated": done.n_prompt_tokens, "tokens_cached": int(t.get("cache_n", 0)),
                "truncated": bool(t.get("n_shifted")), "has_new_line": "\n" in self.text,
                "stop_type": STOP_TYPES.get(self.finish or "", "none"), "stopping_word": self.stop_word,
                "timings": llama_timings(done.n_prompt_tokens, n_gen, t)}


@router.post("/infill")
async def infill(request: Request):
    """llama-server's POST /infill: the middle between input_prefix and input_suffix."""
    server = server_of(request)
    missing = fim_missing(server.vocab)
    if missing:
        raise APIError(400, f"infill is not supported by this model: it has no FIM {', '.join(missing)} token "
                            "(tokenizer.ggml.fim_*_token_id)", code="not_supported")
    body = await read_json(request)
    server.check_model(body)
    b = server.engine.batcher
    req = await run_in_threadpool(InfillRequest.parse, body, server.vocab, n_slots=b.n_slots,
                                  n_batch=server.llm.ctx.n_batch, n_ctx_slot=b.n_ctx_slot,
                                  n_adapters=len(server.llm.adapters))
    check_prompt_length(server, req.tokens, "input_prefix")
    run = Run(server.engine, [req.tokens], req.params, req.cache_prompt, prompt_field="input_prefix")
    pending = await run.start(request)
    out = Completion(server, len(req.tokens))
    if req.stream:
        return StreamingResponse(_stream(request, run, out, pending), media_type="text/event-stream",
                                 headers=HEADERS)
    try:
        for _, ev in pending:
            out.apply(ev)
        while out.done is None:
            out.apply((await run.next(request))[1])
    except BaseException:
        run.cancel()
        raise
    log_done(request.url.path, run, out.n_prompt, len(out.tokens), [out.finish])
    return out.final(stream=False)


async def _stream(request: Request, run: Run, out: Completion, pending: list) -> AsyncIterator[str]:
    """The `data:` events of a streamed infill; an error ends it with a `data: {"error"}` event.
    Closing the stream (finished or the client gone) cancels the job."""
    try:
        queue = list(pending)
        while out.done is None:
            _, ev = queue.pop(0) if queue else await run.next(request, poll=False)
            chunk = out.apply(ev)
            if chunk is not None:
                yield event(chunk)
        yield event(out.final(stream=True))
        log_done(request.url.path, run, out.n_prompt, len(out.tokens), [out.finish])
    except APIError as e:
        yield event({"error": {"message": e.message, "type": e.type, "code": e.status}})
    finally:
        run.cancel()


# ---- /rerank ---------------------------------------------------------------------------------

def rerank_unsupported(server: ServerState) -> str | None:
    """Why this server cannot rerank (None when it can)."""
    model = server.llm.model
    if model.cls is None and model.cls_out is None:
        return "reranking is not supported by this model: it has no classifier head (cls / cls.output)"
    if model.hparams.pooling_type != PoolingType.RANK and not server.reranking:
        return ("reranking is not supported by this model: its pooling type is "
                f"'{model.hparams.pooling_type.name.lower()}', not 'rank' (start the server with --reranking)")
    return None


def rerank_tokens(vocab: Vocab, template: str | None, query: str, doc: str) -> list[int]:
    """One (query, document) pair's tokens, as llama-server's format_prompt_rerank makes them."""
    if template is not None:
        return vocab.tokenize(template.replace("{query}", query).replace("{document}", doc), False, True)
    eos = vocab.eos if vocab.eos != LLAMA_TOKEN_NULL else vocab.sep
    out: list[int] = []
    if vocab.add_bos:
        out.append(vocab.bos)
    out += vocab.tokenize(query, False, False)
    if vocab.add_eos:
        out.append(eos)
    if vocab.add_sep:
        out.append(vocab.sep)
    out += vocab.tokenize(doc, False, False)
    if vocab.add_eos:
        out.append(eos)
    return out


@dataclass(frozen=True)
class RerankRequest:
    """POST /rerank: Jina's fields (query, documents, top_n, return_documents) or TEI's (query,
    texts, return_text)."""

    query: str
    documents: list[str]
    top_n: int
    tei: bool
    return_text: bool

    @classmethod
    def parse(cls, body: dict) -> RerankRequest:
        query = body.get("query")
        if not isinstance(query, str):
            raise bad("query", "'query' is required: a string")
        tei = "texts" in body and "documents" not in body
        name = "texts" if tei else "documents"
        docs = body.get(name)
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise bad(name, f"'{name}' must be a non-empty list of strings")
        if len(docs) > MAX_RERANK_DOCUMENTS:
            raise bad(name, f"'{name}' has {len(docs)} items; at most {MAX_RERANK_DOCUMENTS} per request")
        top_n = _int(body, "top_n", len(docs), lo=0)
        return_text = _bool(body, "return_text" if tei else "return_documents", False)
        return cls(query, docs, top_n, tei, return_text)


def rerank_scores(server: ServerState, tokens: list[list[int]], gone: threading.Event) -> np.ndarray:
    """The first classifier output of each pair (llama-server's score), on the embedding context."""
    with server.embed_lock:
        out = server.llm.embed(tokens, normalize=False, pooling_type="rank", abort_callback=gone.is_set)
    return out[:, 0]


@router.post("/rerank")
@router.post("/reranking")
@router.post("/v1/rerank")
@router.post("/v1/reranking")
async def rerank(request: Request):
    """llama-server's rerank: each document's relevance to the query, best first."""
    server = server_of(request)
    why = rerank_unsupported(server)
    if why is not None:
        raise APIError(400, why, code="not_supported")
    body = await read_json(request)
    server.check_model(body)
    req = RerankRequest.parse(body)
    template = server.llm.model.meta.get("tokenizer.chat_template.rerank")
    template = template if isinstance(template, str) else None
    tokens = await run_in_threadpool(lambda: [rerank_tokens(server.vocab, template, req.query, d)
                                              for d in req.documents])
    room = min(server.llm.ctx.n_ubatch, server.llm.ctx.n_ctx)
    for i, t in enumerate(tokens):
        if len(t) > room:
            name = "texts" if req.tei else "documents"
            raise bad(name, f"'{name}' item {i} with the query has {len(t)} tokens; a pair may have {room} "
                            "(it is scored in one ubatch)")
    gone = threading.Event()
    watch = asyncio.create_task(watch_disconnect(request, gone))
    try:
        scores = await run_in_threadpool(rerank_scores, server, tokens, gone)
    except EmbedAborted:
        raise asyncio.CancelledError("client disconnected") from None
    except ValueError as e:
        raise bad("texts" if req.tei else "documents", str(e)) from None
    finally:
        watch.cancel()
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:req.top_n]
    label = "score" if req.tei else "relevance_score"
    results = []
    for i in order:
        r: dict = {"index": i, label: float(scores[i])}
        if req.return_text:
            r.update({"text": req.documents[i]} if req.tei else {"document": {"text": req.documents[i]}})
        results.append(r)
    n_tok = sum(map(len, tokens))
    if req.tei:
        return JSONResponse(results)
    model = body.get("model") if isinstance(body.get("model"), str) else server.model_name
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
            "results": results}


