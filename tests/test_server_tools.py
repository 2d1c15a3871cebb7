"""Tool calls and reasoning in /v1/chat/completions, over real HTTP with the official openai client
(`python -m llm serve` in a subprocess, tests/test_server.py's Server) and in-process for the 4xx
answers.

- SmolLM2's own template (no tool markup: the generic JSON format) with tool_choice "required":
  the arguments are valid for the called tool's schema on every seed, plain and streamed.
- A tiny model whose template is Hermes-style (Qwen's <tool_call>): the call is written in that
  native markup, constrained, and parsed back (markup never in content); tool results go back.
- A tiny model whose template opens <think>: reasoning_content and a clean content, also
  streamed as delta.reasoning_content; thinking off, or reasoning_format "none", keeps it out.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from starlette.testclient import TestClient
from test_chat_formats import HERMES, OPENS_THINK
from test_server import Server
from tiny_model import TinySpec, model_kv, model_tensors, write_gguf

import llm
from llm.serving import Engine
from llm.serving.app import create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "minLength": 1, "maxLength": 8}}, "required": ["tz"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
SEEDS = range(10)
# the thinking text and the answer, as a grammar forces the random tiny model to write them
THINK_GRAMMAR = 'root ::= [a-z]{3,10} "\\n</think>\\n\\n" [a-z]{3,10}'


def tiny_gguf(path, template: str, seed: int = 5):
    spec = TinySpec(seed=seed)
    return write_gguf(path, {**model_kv(spec), "tokenizer.chat_template": template}, model_tensors(spec))


def check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"]
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


def streamed(stream) -> dict:
    """The chunks of a streamed chat completion put together, as a client does."""
    out: dict = {"content": "", "reasoning_content": "", "calls": {}, "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                if tc.id:
                    assert not call["id"], "a call's id comes once"
                    call["id"] = tc.id
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][k] for k in sorted(out["calls"])]
    return out


def model_of(client) -> str:
    return client.models.list().data[0].id


def as_dicts(calls) -> list[dict]:
    return [c.model_dump(include={"id", "type", "function"}) for c in calls or []]


# ---- SmolLM2: the generic JSON format -------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_path, tmp_path_factory):
    s = Server(smollm2_path, tmp_path_factory.mktemp("smol") / "server.log", "-np", "2", "-c", "2048",
               "--no-warmup")
    yield s
    s.stop()


@pytest.mark.slow
def test_required_call_is_schema_valid_on_every_seed(smol):
    client = smol.client()
    for seed in SEEDS:
        args = dict(model=model_of(client), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                    seed=seed,
                    max_tokens=120)
        r = client.chat.completions.create(**args)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None
        check_calls(as_dicts(choice.message.tool_calls))
        s = streamed(client.chat.completions.create(**args, stream=True))
        assert s["finish"] == "tool_calls" and s["content"] == "", (seed, s)
        check_calls(s["calls"])
        assert [c["function"] for c in s["calls"]] == [c["function"] for c in as_dicts(choice.message.tool_calls)]


@pytest.mark.slow
def test_named_function_and_tool_results(smol):
    client = smol.client()
    r = client.chat.completions.create(model=model_of(client), messages=ASK, tools=TOOLS, temperature=0,
                                       max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = as_dicts(r.choices[0].message.tool_calls)
    assert call["function"]["name"] == "get_time"
    check_calls([call])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    r = client.chat.completions.create(model=model_of(client), messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


# ---- a Hermes-style template: native markup --------------------------------------------------------

@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    d = tmp_path_factory.mktemp("hermes")
    s = Server(tiny_gguf(d / "hermes.gguf", HERMES), d / "server.log", "-np", "2", "-c", "4096", "--no-warmup")
    yield s
    s.stop()


@pytest.mark.slow
def test_hermes_call_is_parsed_from_its_native_markup(hermes):
    client = hermes.client()
    for seed in SEEDS:
        args = dict(model=model_of(client), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                    seed=seed,
                    max_tokens=240)
        r = client.chat.completions.create(**args)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None
        check_calls(as_dicts(choice.message.tool_calls))
        s = streamed(client.chat.completions.create(**args, stream=True))
        assert s["finish"] == "tool_calls" and "<tool_call>" not in s["content"], s
        check_calls(s["calls"])
        assert [c["function"] for c in s["calls"]] == [c["function"] for c in as_dicts(choice.message.tool_calls)]
    raw = client.completions.create(model=model_of(client), prompt="x", max_tokens=1)      # the server is still sane
    assert raw.choices[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_hermes_parallel_calls_and_tool_results(hermes):
    client = hermes.client()
    r = client.chat.completions.create(model=model_of(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=True, temperature=1.0, seed=1, max_tokens=300)
    calls = as_dicts(r.choices[0].message.tool_calls)
    check_calls(calls)
    assert len({c["id"] for c in calls}) == len(calls)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": "18 C"} for c in calls]
    r = client.chat.completions.create(model=model_of(client), messages=history, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---- a template that opens <think> -----------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    d = tmp_path_factory.mktemp("think")
    s = Server(tiny_gguf(d / "think.gguf", OPENS_THINK), d / "server.log", "-np", "1", "-c", "512", "--no-warmup")
    yield s
    s.stop()


@pytest.mark.slow
def test_reasoning_content_when_the_template_opens_think(thinker):
    client = thinker.client()
    args = dict(model=model_of(client), messages=ASK, temperature=1.0, seed=3, max_tokens=40,
                extra_body={"grammar": THINK_GRAMMAR})
    r = client.chat.completions.create(**args)
    msg = r.choices[0].message
    thought, answer = msg.model_extra["reasoning_content"], msg.content
    assert thought.isalpha() and answer.isalpha(), msg
    s = streamed(client.chat.completions.create(**args, stream=True))
    assert (s["reasoning_content"], s["content"]) == (thought, answer)
    plain = client.chat.completions.create(**{**args, "extra_body": {"grammar": THINK_GRAMMAR,
                                                                     "reasoning_format": "none"}})
    assert plain.choices[0].message.content == f"{thought}\n</think>\n\n{answer}"
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    off = client.chat.completions.create(**{**args, "extra_body": {
        "grammar": 'root ::= [a-z]{3,10}', "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.choices[0].message.content.isalpha() and not (off.choices[0].message.model_extra or {}).get(
        "reasoning_content")
    assert off.usage.prompt_tokens > r.usage.prompt_tokens          # the prompt closed the think block


# ---- 4xx answers (in-process) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tiny = llm.LLM(tiny_gguf(tmp_path_factory.mktemp("t") / "hermes.gguf", HERMES), n_ctx=2048, n_seq_max=1)
    engine = Engine(tiny.ctx, tiny.vocab, n_slots=1).start()
    with TestClient(create_app(tiny, engine, model_name="tiny")) as c:
        yield c
    engine.stop()


def error(r, param: str) -> str:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param, e
    return e["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": "get_time"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "grammar": 'root ::= "x"'}, "grammar"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]}, "messages[2].tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "content": "12:00"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].id"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
])
def test_bad_tool_requests_are_400_naming_the_field(app, body, param):
    r = app.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    error(r, param)
    assert app.get("/health").json()["slots_processing"] == 0


@pytest.mark.slow
def test_tool_results_are_accepted_in_process(app):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = app.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 240,
                                               "tool_choice": "required", "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    check_calls(choice["message"]["tool_calls"])


def test_server_reasoning_settings(tmp_path_factory):
    """--reasoning-budget 0: the prompt closes the think block the template opened (the reply is
    content); --reasoning-format none: the thinking stays in content."""
    from llm.params import ReasoningParams
    thinker = llm.LLM(tiny_gguf(tmp_path_factory.mktemp("r") / "think.gguf", OPENS_THINK), n_ctx=512, n_seq_max=1)
    engine = Engine(thinker.ctx, thinker.vocab, n_slots=1).start()
    body = {"messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 3, "grammar": THINK_GRAMMAR}
    try:
        for settings, reasoning in [(ReasoningParams(), True), (ReasoningParams(reasoning_format="none"), False),
                                    (ReasoningParams(reasoning_budget=0), False)]:
            with TestClient(create_app(thinker, engine, model_name="t", reasoning=settings)) as c:
                msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert ("reasoning_content" in msg) == reasoning, (settings, msg)
            assert ("</think>" in msg["content"]) != reasoning, (settings, msg)
    finally:
        engine.stop()
