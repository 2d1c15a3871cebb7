"""The server's structure, without a model: every route is a module-level handler in
llm.serving.routes (adding a route is adding one function), the SSE helper's framing and
close handling, the request parsers' defaults and field-named errors, and the names
llm.serving.app (llm.server) has always had."""
from __future__ import annotations

import importlib
import inspect

import pytest
from fastapi import FastAPI
from starlette.routing import Route
from starlette.testclient import TestClient

from llm.sampling.samplers import LLAMA_DEFAULT_SEED, SamplingParams
from llm.serving import routes
from llm.serving.requests import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from llm.serving.sse import sse_response

APP_NAMES = ["create_app", "model_name_of", "APIError", "gen_params", "embedding_inputs", "chat_messages",
             "completion_prompts", "read_json", "Run", "chat_logprobs", "text_logprobs", "MAX_BODY_BYTES",
             "MAX_STOP", "CHAT_ROLES"]


def test_every_route_is_a_module_level_function():
    paths = set()
    for r in routes.router.routes:
        assert isinstance(r, Route)
        fn = r.endpoint
        assert inspect.iscoroutinefunction(fn), r.path
        assert fn.__qualname__ == fn.__name__ and getattr(routes, fn.__name__) is fn, r.path
        paths.add(r.path)
    assert {"/health", "/slots", "/slots/{slot}", "/v1/models", "/v1/embeddings", "/tokenize", "/detokenize",
            "/v1/chat/completions", "/v1/completions"} <= paths


@pytest.mark.parametrize("module", ["llm.serving.app", "llm.server"])
def test_app_names_still_import(module):
    m = importlib.import_module(module)
    for name in APP_NAMES:
        assert getattr(m, name) is not None, name


def stream_app(objects: list, fail_after: int | None, closed: list) -> TestClient:
    async def gen():
        for i, obj in enumerate(objects):
            if i == fail_after:
                raise APIError(500, "boom", type="server_error")
            yield obj

    app = FastAPI()

    @app.get("/s")
    async def s():
        return sse_response(gen(), lambda: closed.append(True))
    return TestClient(app)


def test_sse_frames_end_with_done():
    closed: list = []
    r = stream_app([{"a": 1}, {"b": [2]}], None, closed).get("/s")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.text == 'data: {"a": 1}\n\ndata: {"b": [2]}\n\ndata: [DONE]\n\n'
    assert closed == [True]


def test_sse_error_mid_stream_is_an_error_event_without_done():
    closed: list = []
    r = stream_app([{"a": 1}, {"b": 2}], 1, closed).get("/s")
    assert r.status_code == 200
    assert r.text == ('data: {"a": 1}\n\ndata: {"error": {"message": "boom", "type": "server_error", '
                      '"param": null, "code": null}}\n\n')
    assert closed == [True]


def test_sampling_params_defaults_are_llama_cpp_defaults():
    assert sampling_params({}, 10) == SamplingParams()
    p = sampling_params({"seed": -1, "temperature": 0, "top_k": 0, "repeat_penalty": 1.1, "logit_bias": {"3": -5}}, 10)
    assert (p.seed, p.temp, p.top_k, p.penalty_repeat, p.logit_bias) == (0xFFFFFFFF, 0.0, 0, 1.1, {3: -5.0})
    assert sampling_params({"seed": None}, 10).seed == LLAMA_DEFAULT_SEED


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": "x"}, "top_p"), ({"mirostat": 3}, "mirostat"),
    ({"min_p": True}, "min_p"), ({"repeat_last_n": -2}, "repeat_last_n"), ({"seed": 1.5}, "seed"),
    ({"samplers": ["top_k", "nope"]}, "samplers"), ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"logit_bias": {"10": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
])
def test_sampling_params_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        sampling_params(body, 10)
    assert e.value.status == 400 and e.value.param == param


def test_request_dataclasses():
    chat = ChatCompletionRequest.parse({"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}],
                                        "stream": True, "stream_options": {"include_usage": True}, "n": 2},
                                       n_slots=2, n_vocab=10)
    assert chat.messages == [{"role": "system", "content": "x"}]
    assert (chat.stream, chat.include_usage, chat.cache_prompt, chat.params.n) == (True, True, False, 2)
    assert chat.params.max_tokens is None
    cmpl = CompletionRequest.parse({"prompt": ["ab", [1, 2]], "logprobs": 2}, lambda s: [len(s)], n_slots=1,
                                   n_vocab=10)
    assert cmpl.prompts == [[2], [1, 2]] and cmpl.params.max_tokens == 16 and cmpl.params.top_logprobs == 2
    assert TokenizeRequest.parse({"content": "hi"}) == TokenizeRequest("hi", False, False)
    assert DetokenizeRequest.parse({"tokens": [1, 9]}, n_vocab=10).tokens == [1, 9]
    for parse, body, param in [
        (lambda b: ChatCompletionRequest.parse(b, n_slots=1, n_vocab=10), {"messages": []}, "messages"),
        (lambda b: ChatCompletionRequest.parse(b, n_slots=1, n_vocab=10),
         {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        (lambda b: ChatCompletionRequest.parse(b, n_slots=1, n_vocab=10),
         {"messages": [{"role": "user", "content": "x"}], "stream_options": 1}, "stream_options"),
        (TokenizeRequest.parse, {"content": 1}, "content"),
        (lambda b: DetokenizeRequest.parse(b, n_vocab=10), {"tokens": [10]}, "tokens"),
    ]:
        with pytest.raises(APIError) as e:
            parse(body)
        assert e.value.param == param
