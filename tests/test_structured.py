"""Constrained generation through llm.LLM: grammar= / json_schema= / JSON-object mode, tool calls
in chat, errors before decoding, finish reasons, and the prompt cache. Tiny generated models for
the mechanics; the real models (slow) for JSON-schema outputs validated with jsonschema."""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from tiny_model import TinySpec, write_model

import llm
import llm.sampling as sampling
from llm.chat import tool_calls as tools
from llm.prompt_cache import PromptCache

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "floor": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["city", "floor"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "code", "age", "color", "home", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llm.LLM(write_model(tmp_path_factory.mktemp("s") / "tiny.gguf", TinySpec(seed=5)), n_ctx=1024)


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_on_tiny_model_validates(tiny, seed):
    out = tiny.generate("x", max_tokens=200, temperature=1.0, seed=seed, json_schema=SCHEMA)
    assert out.finish_reason == "eog", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_grammar_and_json_object_mode(tiny):
    out = tiny.generate("x", max_tokens=40, temperature=1.0, seed=3, grammar='root ::= ("yes" | "no") "."')
    assert out.text.strip() in ("yes.", "no."), out.text
    out = tiny.generate("x", max_tokens=120, temperature=0.0, grammar=sampling.json_object())
    if out.finish_reason == "eog":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_unfinishable_grammar_ends_by_length(tiny):
    out = tiny.generate("x", max_tokens=8, temperature=1.0, seed=1, grammar='root ::= "q"{100}')
    assert out.finish_reason == "length" and len(out.tokens) == 8
    assert set(out.text.strip()) <= {"q"}


@pytest.mark.parametrize("kw,error", [
    ({"grammar": 'root ::= "a'}, "unterminated"),
    ({"json_schema": {"type": "nope"}}, "invalid schema"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "either"),
])
def test_bad_constraint_raises_before_decoding(tiny, kw, error):
    n_eval = tiny.ctx.perf()["n_eval"] + tiny.ctx.perf()["n_p_eval"]
    with pytest.raises(ValueError, match=error):
        tiny.stream("hello", max_tokens=4, **kw)
    assert tiny.ctx.perf()["n_eval"] + tiny.ctx.perf()["n_p_eval"] == n_eval


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
        "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.slow
def test_tool_call_is_parsed_and_matches_schema(tiny, choice):
    out = tiny.chat([{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, tool_choice=choice,
                    max_tokens=120, temperature=0.7, seed=2)
    assert out.finish_reason == "tool_calls" and out.text == ""
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    fn = next(t["function"] for t in WEATHER if t["function"]["name"] == call["function"]["name"])
    if isinstance(choice, dict):
        assert fn["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_native_format_tool_call_and_reasoning_in_the_python_api(tmp_path, stream):
    """LLM.chat with a Hermes-style template: the call is constrained and parsed from <tool_call>
    markup (chat_stream's chunks carry no markup); with a template that opens <think>, the reply's
    reasoning is apart from its text."""
    from test_chat_formats import HERMES, OPENS_THINK
    from tiny_model import model_kv, model_tensors, write_gguf
    spec = TinySpec(seed=5)
    paths = [write_gguf(tmp_path / f"{n}.gguf", {**model_kv(spec), "tokenizer.chat_template": t}, model_tensors(spec))
             for n, t in (("hermes", HERMES), ("think", OPENS_THINK))]
    hermes = llm.LLM(paths[0], n_ctx=2048)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(tools=WEATHER, tool_choice="required", max_tokens=200, temperature=0.7, seed=1)
    if stream:
        chunks = list(hermes.chat_stream(ask, **kw))
        assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"
        out = chunks[-1].completion
    else:
        out = hermes.chat(ask, **kw)
    assert out.finish_reason == "tool_calls" and out.text == ""
    (call,) = out.tool_calls
    fn = next(t["function"] for t in WEATHER if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
    thinker = llm.LLM(paths[1], n_ctx=512)
    out = thinker.chat(ask, max_tokens=40, temperature=1.0, seed=2,
                       grammar='root ::= [a-z]{3,10} "\\n</think>\\n\\n" [a-z]{3,10}')
    assert out.reasoning_content.isalpha() and out.text.isalpha(), out


def test_tools_bad_input():
    with pytest.raises(llm.GrammarError, match="tools"):
        tools.check_tools([{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(llm.GrammarError, match="tool_choice"):
        tools.reply_schema(tools.check_tools(WEATHER), {"type": "function", "function": {"name": "nope"}})
    content, calls = tools.parse_reply('{"response": "hi"}')
    assert content == "hi" and calls is None
    history = tools.with_tools([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], WEATHER)
    assert history[0]["role"] == "system" and '"get_time"' in history[1]["content"]


@pytest.mark.slow
def test_prompt_cache_reuses_prefix_across_instances(tmp_path):
    path = write_model(tmp_path / "tiny.gguf", TinySpec(seed=6))
    prompt = list(range(3, 3 + 120))
    cold = llm.LLM(path, n_ctx=256, prompt_cache=tmp_path / "pc")
    want = cold.generate(prompt, max_tokens=6, temperature=0.0)
    assert cold.prompt_cache.misses == 1 and list((tmp_path / "pc").glob("*/*.state"))
    warm = llm.LLM(path, n_ctx=256, prompt_cache=tmp_path / "pc")
    got = warm.generate(prompt[:100] + [7, 8, 9], max_tokens=6, temperature=0.0)
    assert warm.prompt_cache.hits == 1 and got.n_prompt_tokens == 103
    assert warm.ctx.perf()["n_p_eval"] == 3          # 100 tokens restored, 3 evaluated
    again = warm.generate(prompt, max_tokens=6, temperature=0.0)
    assert again.tokens == want.tokens


@pytest.mark.slow
def test_prompt_cache_evicts_least_recently_used(tmp_path):
    path = write_model(tmp_path / "tiny.gguf", TinySpec(seed=6))
    m = llm.LLM(path, n_ctx=256, prompt_cache=tmp_path / "pc", prompt_cache_bytes=1)
    m.generate(list(range(3, 80)), max_tokens=1, temperature=0.0)
    assert not list((tmp_path / "pc").glob("*/*.state"))       # larger than the cap: memory only
    size = len(m.ctx.state_seq_get_data(0, list(range(3, 80))))
    m = llm.LLM(path, n_ctx=256, prompt_cache=tmp_path / "pc", prompt_cache_bytes=int(size * 2.5))
    for start in (3, 100, 200):
        m.reset()
        m.generate(list(range(start, start + 77)), max_tokens=1, temperature=0.0)
    on_disk = {p.name for p in (tmp_path / "pc").glob("*/*.state")}
    keys = [PromptCache._key(list(range(start, start + 77))) + ".state" for start in (3, 100, 200)]
    assert on_disk == set(keys[1:])                   # the least recently used one went


# ---- real models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request):
    path = request.getfixturevalue(f"{request.param}_path")
    return llm.LLM(path, n_ctx=1024)


@pytest.mark.slow
def test_json_schema_real_models_validate(real):
    messages = [{"role": "user", "content": "Describe a fictional person as JSON with name, code, age, color, "
                                            "home (city, floor) and tags."}]
    for temperature, seed in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)]:
        out = real.chat(messages, max_tokens=160, temperature=temperature, seed=seed, json_schema=SCHEMA)
        assert out.finish_reason == "eog", (temperature, seed, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.slow
def test_tool_call_real_models(real):
    out = real.chat([{"role": "user", "content": "What is the weather in Paris in celsius?"}], tools=WEATHER,
                    tool_choice="required", max_tokens=80, temperature=0.0)
    assert out.finish_reason == "tool_calls", out.text
    call = out.tool_calls[0]["function"]
    fn = next(t["function"] for t in WEATHER if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), fn["parameters"])


@pytest.mark.slow
def test_prompt_cache_new_process_restores(tmp_path, smollm2_path):
    code = ("import sys, llm; m = llm.LLM(sys.argv[1], n_ctx=512, prompt_cache=sys.argv[2]); "
            "c = m.generate('The history of tea is long. ' * 20 + 'In short,', max_tokens=5, temperature=0.0); "
            "print(m.prompt_cache.hits, c.tokens)")
    runs = [subprocess.run([sys.executable, "-c", code, str(smollm2_path), str(tmp_path / "pc")], check=True,
                           capture_output=True, text=True).stdout.split(" ", 1) for _ in range(2)]
    assert runs[0][0] == "0" and runs[1][0] == "1"
    assert runs[0][1] == runs[1][1]


def test_response_format():
    from llm.sampling.structured import spec_response_format
    assert spec_response_format(None) is None and spec_response_format({"type": "text"}) is None
    assert spec_response_format({"type": "json_object"}).what == "json_schema"
    spec = spec_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert spec == sampling.json_schema(SCHEMA)
    for bad, field in [({"type": "xml"}, "response_format.type"), ({"type": "json_schema"}, "json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": 3}}}, "invalid schema"),
                       ([], "expected an object")]:
        with pytest.raises(llm.GrammarError, match=field):
            spec_response_format(bad)


def test_tools_reach_a_template_that_uses_them(tiny):
    tiny.model.meta["tokenizer.chat_template"] = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    try:
        text = tiny.render_chat(tools.with_tools([{"role": "user", "content": "hi"}], WEATHER), tools=WEATHER)
    finally:
        del tiny.model.meta["tokenizer.chat_template"]
    assert text.startswith("[tool get_weather][tool get_time]<system>You can call these tools")
