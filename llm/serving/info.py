"""llama-server's GET /props and GET /metrics: what a client or a monitor reads about the server.

/props says how the server is set up (slots, context, sampling defaults, chat template);
/metrics (with `serve --metrics`) is the Prometheus text of the engine's counters
(llm.serving.metrics), which the engine thread keeps and this route only reads.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from llm import params
from llm.chat.templates import template_for
from llm.generation.core import GenParams
from llm.params import ServerEndpoints
from llm.sampling.samplers import SamplingParams
from llm.serving.completions import piece
from llm.serving.metrics import prometheus
from llm.serving.requests import APIError
from llm.serving.routes import server_of

router = APIRouter()


def build_info() -> str:
    """The package's version (llama-server reports its build number here)."""
    try:
        return f"ggmlx-{importlib.metadata.version('ggmlx')}"
    except importlib.metadata.PackageNotFoundError:     # run from a source tree that is not installed
        return "ggmlx-source"


def endpoints_of(request: Request) -> ServerEndpoints:
    return request.app.state.endpoints


def default_params() -> dict:
    """The sampling settings a request that sets none gets, with llama-server's names (n_predict
    -1: until the end of generation or a full slot)."""
    out: dict = {"n_predict": -1, "n": GenParams().n}
    for k, v in params.request_defaults(SamplingParams).items():
        out[k] = list(v) if isinstance(v, tuple) else [[int(t), b] for t, b in v.items()] if isinstance(v, dict) else v
    return out


def token_text(vocab, token: int) -> str:
    return piece(vocab.token_to_piece(token, special=True)) if token >= 0 else ""


@router.get("/props")
async def props(request: Request):
    """llama-server's GET /props, the fields that apply here. model_path is the file's name only:
    the route is public to every client, the server's directories are not."""
    server = server_of(request)
    endpoints = endpoints_of(request)
    model, vocab, batcher = server.llm.model, server.vocab, server.engine.batcher
    return {
        "default_generation_settings": {"params": default_params(), "n_ctx": batcher.n_ctx_slot},
        "total_slots": batcher.n_slots,
        "model_alias": server.model_name,
        "model_path": Path(model.path).name,
        "modalities": {"vision": server.llm.mtmd is not None and server.llm.mtmd.support_vision(),
                       "audio": server.llm.mtmd is not None and server.llm.mtmd.support_audio()},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": endpoints.metrics,
        "webui": endpoints.webui,
        "chat_template": template_for(model.meta, model.arch),
        "bos_token": token_text(vocab, vocab.bos),
        "eos_token": token_text(vocab, vocab.eos),
        "build_info": build_info(),
    }


@router.get("/metrics")
async def metrics(request: Request):
    """llama-server's GET /metrics (Prometheus text); 501 without `serve --metrics`, as there."""
    if not endpoints_of(request).metrics:
        raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                       type="not_supported_error", code="not_supported")
    engine = server_of(request).engine
    reading = engine.metrics.read(reset_bucket=True)
    return PlainTextResponse(prometheus(reading, engine.snapshot), media_type="text/plain; version=0.0.4",
                             headers={"Process-Start-Time-Unix": str(int(reading.t_start))})
