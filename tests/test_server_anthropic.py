"""/v1/messages (Anthropic's Messages API) over real HTTP with the official anthropic client
(`python -m llm serve` in a subprocess, tests/test_server.py's Server), on a tiny model whose
template is Hermes-style: text replies plain and streamed, stop_sequences, system blocks, tool_use
under every tool_choice with schema-valid input, tool_result round trips, count_tokens; in-process:
the 4xx answers in Anthropic's error shape, the API key as X-Api-Key, and the stream's events for
a reply that thinks (thinking block, then text)."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest
from starlette.testclient import TestClient
from test_chat_formats import HERMES, OPENS_THINK
from test_server import Server
from test_server_tools import tiny_gguf

import llm
from llm.chat import prompt as prompt_mod
from llm.generation.batcher import Done
from llm.generation.core import Delta
from llm.serving import Engine
from llm.serving.anthropic import Reply
from llm.serving.app import create_app

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "additionalProperties": False, "required": ["tz"],
                                             "properties": {"tz": {"type": "string", "minLength": 1, "maxLength": 8}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("anthropic")
    s = Server(tiny_gguf(d / "hermes.gguf", HERMES), d / "server.log", "-np", "2", "-c", "4096", "--no-warmup")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server):
    return server.client().models.list().data[0].id


def check_tool_use(blocks) -> list:
    uses = [b for b in blocks if b.type == "tool_use"]
    assert uses, blocks
    for b in uses:
        assert b.id
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


@pytest.mark.slow
def test_text_reply_plain_and_streamed(client, model):
    # this client has no sampling arguments (temperature, top_p, top_k): they go in the body
    args = dict(model=model, max_tokens=12, extra_body={"temperature": 0}, messages=ASK,
                system=[{"type": "text", "text": "Answer briefly."}, {"type": "text", "text": " In English."}])
    r = client.messages.create(**args)
    assert r.type == "message" and r.role == "assistant" and r.model == model
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    with client.messages.stream(**args) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == r.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # a stop sequence taken from the greedy reply ends it there
    word = r.content[0].text.strip().split()[-1][:3]
    cut = client.messages.create(**{**args, "stop_sequences": ["\u2603", word]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word, cut
    assert word not in cut.content[0].text if cut.content else True
    n = client.messages.count_tokens(model=model, messages=ASK, system=args["system"])
    assert n.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)


@pytest.mark.slow
def test_tool_use_any_on_seeds_plain_and_streamed(client, model):
    for seed in range(3):
        args = dict(model=model, max_tokens=240, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                    extra_body={"temperature": 1.0, "seed": seed})
        r = client.messages.create(**args)
        assert r.stop_reason == "tool_use", r
        uses = check_tool_use(r.content)
        assert not any(b.type == "text" and "<tool_call>" in b.text for b in r.content)
        with client.messages.stream(**args) as s:
            events = [e.type for e in s]
            final = s.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop", events
        assert "content_block_start" in events and "message_delta" in events
        assert final.stop_reason == "tool_use"
        streamed = check_tool_use(final.content)
        assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]


@pytest.mark.slow
def test_parallel_tool_use_blocks_are_numbered_in_order(client, model):
    args = dict(model=model, max_tokens=300, messages=ASK, tools=TOOLS, extra_body={"temperature": 1.0, "seed": 1},
                tool_choice={"type": "any", "disable_parallel_tool_use": False})
    r = client.messages.create(**args)
    uses = check_tool_use(r.content)
    assert len({b.id for b in uses}) == len(uses)
    with client.messages.stream(**args) as s:
        starts = [e.index for e in s if e.type == "content_block_start"]
        final = s.get_final_message()
    assert starts == list(range(len(final.content)))
    assert [(b.name, b.input) for b in check_tool_use(final.content)] == [(b.name, b.input) for b in uses]


@pytest.mark.slow
def test_named_tool_and_tool_result_round_trip(client, model):
    r = client.messages.create(model=model, max_tokens=120, messages=ASK, tools=TOOLS, extra_body={"temperature": 0},
                               tool_choice={"type": "tool", "name": "get_time"})
    (use,) = check_tool_use(r.content)
    assert use.name == "get_time" and r.stop_reason == "tool_use"
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": "12:00"}]},
                                                  {"type": "text", "text": "And now?"}]}]
    again = client.messages.create(model=model, max_tokens=8, messages=history, tools=TOOLS,
                                   extra_body={"temperature": 0},
                                   tool_choice={"type": "none"})
    assert [b.type for b in again.content] == ["text"] and again.stop_reason in ("max_tokens", "end_turn")
    count = dict(model=model, tools=TOOLS, tool_choice={"type": "none"})
    n_history = client.messages.count_tokens(messages=history, **count).input_tokens
    assert again.usage.input_tokens == n_history > client.messages.count_tokens(messages=ASK, **count).input_tokens


# ---- in-process: errors and the API key --------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tiny = llm.LLM(tiny_gguf(tmp_path_factory.mktemp("t") / "hermes.gguf", HERMES), n_ctx=2048, n_seq_max=1)
    engine = Engine(tiny.ctx, tiny.vocab, n_slots=1).start()
    with TestClient(create_app(tiny, engine, model_name="tiny", api_key="k")) as c:
        yield c
    engine.stop()


KEY = {"x-api-key": "k"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"tz": "UTC"}}


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [USE]}]}, "messages[0].content[0].type"),
    ({"messages": ASK + [{"role": "assistant", "content": [{**USE, "input": "UTC"}]}]}, "messages[1].content[0].input"),
    ({"messages": ASK + [{"role": "assistant", "content": [{**USE, "id": ""}]}]}, "messages[1].content[0].id"),
    ({"messages": ASK + [{"role": "assistant", "content": [USE]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": ASK + [{"role": "assistant", "content": [USE]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "image"}]}]}]},
     "messages[2].content[0].content[0].type"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"system": 7}, "system"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}, "tools[0].input_schema"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_requests_are_400_in_anthropics_shape(app, body, field):
    r = app.post("/v1/messages", headers=KEY, json={"model": "tiny", "max_tokens": 4, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    e = r.json()
    assert e["type"] == "error" and e["error"]["type"] == "invalid_request_error", e
    assert field in e["error"]["message"], e
    assert app.get("/health").json()["slots_processing"] == 0


def test_errors_outside_the_fields_and_the_api_key(app):
    r = app.post("/v1/messages", json={"max_tokens": 4, "messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = app.post("/v1/messages", headers={"authorization": "Bearer k"}, content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    r = app.post("/v1/messages", headers=KEY, json={"model": "claude-x", "max_tokens": 4, "messages": ASK})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    r = app.post("/v1/messages/count_tokens", headers=KEY, json={"messages": ASK})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    with_tools = app.post("/v1/messages/count_tokens", headers=KEY, json={"messages": ASK, "tools": TOOLS})
    assert with_tools.json()["input_tokens"] > r.json()["input_tokens"]
    # the official client raises its own error class, with the message
    c = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=app, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        c.messages.create(model="tiny", max_tokens=0, messages=ASK)


def test_stream_events_of_a_reply_that_thinks(vocab_only):
    """A template that opens <think>: the thinking block first (its deltas, a signature, its stop),
    then the text block, numbered in order; the whole message has both."""
    chat = prompt_mod.apply(OPENS_THINK, ASK, prompt_mod.ChatOptions(), vocab=vocab_only)
    reply = Reply(chat.syntax, model_name="t", n_prompt=9, stream=True)
    events = reply.start_events()
    for i, piece in enumerate(["hmm, ", "rain", "\n</think>\n\n", "Take an ", "umbrella."]):
        events += reply.apply(Delta(0, piece, [1], [], "eog" if i == 4 else None))
    events += reply.apply(Done(9, 5, {"cache_n": 0}))
    events += reply.end_events()
    kinds = [(name, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for name, d in events]
    assert kinds[:3] == [("message_start", None, None), ("ping", None, None),
                         ("content_block_start", 0, "thinking")]
    thinking = "".join(d["delta"]["thinking"] for _, d in events if d.get("delta", {}).get("type") == "thinking_delta")
    text = "".join(d["delta"]["text"] for _, d in events if d.get("delta", {}).get("type") == "text_delta")
    assert (thinking, text) == ("hmm, rain", "Take an umbrella.")
    i_sig = kinds.index(("content_block_delta", 0, "signature_delta"))
    assert kinds[i_sig + 1:i_sig + 3] == [("content_block_stop", 0, None), ("content_block_start", 1, "text")]
    assert kinds[-3:] == [("content_block_stop", 1, None), ("message_delta", None, None),
                          ("message_stop", None, None)]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 5
    assert [b["type"] for b in reply.message()["content"]] == ["thinking", "text"]


@pytest.fixture(scope="module")
def vocab_only():
    from tiny_model import VOCAB_MODEL
    return llm.load_model(VOCAB_MODEL, vocab_only=True).vocab
