"""Chat formats without a model: detection from the template's source (llama.cpp's order), each
format's parser on its native markup (whole and streamed a character at a time: the deltas
add up to the whole, markup never reaches content, partial markers are held back), the prompt
a template makes of tools, tool calls and tool results, reasoning (a template that opens
<think>, thinking off), and each format's grammar run token by token over the committed
synthetic vocabulary (required calls, lazy grammars that wait for their trigger)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_model import VOCAB_MODEL

import llm
from llm.chat import parsers, prompt, tool_calls
from llm.chat.formats import ChatFormat as F
from llm.chat.formats import ChatSyntax, ReasoningFormat, detect
from llm.chat.grammars import ToolSpec, tool_grammar
from llm.errors import GrammarError
from llm.generation.core import grammar_vocab
from llm.sampling.samplers import TokenDataArray

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ARGS = '{"city": "Paris", "unit": "c"}'

# the telltale markup of each format's template, in the smallest template that has it
TEMPLATES = {
    F.DEEPSEEK_R1: "{{ '<｜tool▁calls▁begin｜>' }}",
    F.COMMAND_R7B: "{{ '<|END_THINKING|><|START_ACTION|>' }}",
    F.GRANITE: "{% if x %}{% elif thinking %}{% endif %}<|tool_call|>",
    F.HERMES_2_PRO: "{{ '<tool_call>' }}",
    F.GPT_OSS: "<|channel|>",
    F.FUNCTIONARY_V3_2: ">>>all",
    F.FIREFUNCTION_V2: " functools[",
    F.FUNCTIONARY_V3_1_LLAMA_3_1: "<|start_header_id|><function=",
    F.LLAMA_3_X: "<|start_header_id|>ipython<|end_header_id|>",
    F.LLAMA_3_X_WITH_BUILTIN_TOOLS: "<|start_header_id|>ipython<|end_header_id|><|python_tag|>",
    F.MISTRAL_NEMO: "[TOOL_CALLS]",
}


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_format_is_detected_from_the_template(fmt):
    assert detect(TEMPLATES[fmt], tools=True, json_schema=False) == fmt


def test_detection_without_tools_or_with_a_schema():
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert detect(chatml, tools=True, json_schema=False) == F.GENERIC
    assert detect(chatml, tools=False, json_schema=False) == F.CONTENT_ONLY
    assert detect(TEMPLATES[F.MISTRAL_NEMO], tools=False, json_schema=False) == F.CONTENT_ONLY
    assert detect(TEMPLATES[F.HERMES_2_PRO], tools=False, json_schema=False) == F.HERMES_2_PRO
    assert detect(TEMPLATES[F.HERMES_2_PRO], tools=True, json_schema=True) == F.GENERIC    # tools + a reply schema


# ---- parsing ------------------------------------------------------------------------------------

# (format, the model's reply, content, reasoning_content, [(name, arguments)], markup that must not reach content)
REPLIES = [
    (F.HERMES_2_PRO, f'<think>\nIt is about weather.\n</think>\n\nLet me check.<tool_call>\n'
                     f'{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
     "Let me check.", "It is about weather.", [("get_weather", ARGS)], ("<tool_call>", "<think>", "{")),
    (F.HERMES_2_PRO, f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
     "", "", [("get_weather", ARGS), ("get_time", '{"tz": "UTC"}')], ("<tool_call>", "{")),
    (F.HERMES_2_PRO, f'<function=get_weather>{ARGS}</function>', "", "", [("get_weather", ARGS)], ("<function",)),
    (F.HERMES_2_PRO, "Plain <b>html</b>, {braces} and `code`.", "Plain <b>html</b>, {braces} and `code`.", "", [],
     ()),
    (F.CONTENT_ONLY, "<think>a plan</think>The answer.", "The answer.", "a plan", [], ("<think>",)),
    (F.MISTRAL_NEMO, f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}, "id": "abcdefghi"}}]',
     "Sure.", "", [("get_weather", ARGS)], ("[TOOL_CALLS]",)),
    (F.LLAMA_3_X, f'{{"name": "get_weather", "parameters": {ARGS}}}', "", "", [("get_weather", ARGS)], ("{",)),
    (F.LLAMA_3_X, '{"not": "a call"}', '{"not": "a call"}', "", [], ()),
    (F.LLAMA_3_X_WITH_BUILTIN_TOOLS, '<|python_tag|>brave_search.call(query="Paris weather")', "", "",
     [("brave_search", '{"query": "Paris weather"}')], ("<|python_tag|>",)),
    (F.DEEPSEEK_R1, f"<think>hmm</think>On it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    f"get_weather\n```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "On it.", "hmm", [("get_weather", ARGS)], ("<｜", "```")),
    (F.FIREFUNCTION_V2, f'OK functools[{{"name": "get_weather", "arguments": {ARGS}}}]', "OK", "",
     [("get_weather", ARGS)], ("functools",)),
    (F.FUNCTIONARY_V3_2, f"all\nChecking.>>>get_weather\n{ARGS}", "Checking.", "", [("get_weather", ARGS)],
     (">>>", "all\n")),
    (F.FUNCTIONARY_V3_2, "python\nprint(1)", "", "", [("python", '{"code": "print(1)"}')], ("python",)),
    (F.FUNCTIONARY_V3_1_LLAMA_3_1, f"Hi<function=get_weather>{ARGS}</function>", "Hi", "",
     [("get_weather", ARGS)], ("<function",)),
    (F.COMMAND_R7B, f'<|START_THINKING|>I need the weather.<|END_THINKING|><|START_ACTION|>[{{"tool_call_id": "0", '
                    f'"tool_name": "get_weather", "parameters": {ARGS}}}]<|END_ACTION|>',
     "", "I need the weather.", [("get_weather", ARGS)], ("<|",)),
    (F.COMMAND_R7B, "<|START_RESPONSE|>Hello!<|END_RESPONSE|>", "Hello!", "", [], ("<|",)),
    (F.GRANITE, f'<think>t</think><response>Sure</response><|tool_call|>[{{"name": "get_weather", '
                f'"arguments": {ARGS}}}]', "Sure", "t", [("get_weather", ARGS)], ("<|", "<response>")),
    (F.GPT_OSS, "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
                "<|message|>Hi there!", "Hi there!", "The user greets.", [], ("<|",)),
    (F.GPT_OSS, f"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
                f"<|channel|>commentary <|constrain|>json<|message|>{ARGS}", "", "Need weather.",
     [("get_weather", ARGS)], ("<|",)),
    (F.GENERIC, f'{{"tool_call": {{"name": "get_weather", "arguments": {ARGS}}}}}', "", "", [("get_weather", ARGS)],
     ("{",)),
    (F.GENERIC, '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]}', "", "",
     [("get_time", '{"tz": "UTC"}')], ("{",)),
    (F.GENERIC, '{"response": "caf\\u00e9 \\"ok\\""}', 'café "ok"', "", [], ("{",)),
]


def syntax(fmt: F, **kw) -> ChatSyntax:
    return ChatSyntax(fmt, parse_tool_calls=True, **kw)


def streamed(fmt: F, text: str, pieces: list[str], **kw) -> tuple[parsers.ChatMsg, list[parsers.MsgDelta]]:
    s = parsers.ChatStream(syntax(fmt, **kw))
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    assert s.message is not None
    return s.message, deltas


def joined(deltas: list[parsers.MsgDelta]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning_content for d in deltas)
    calls: dict[int, list[str]] = {}
    ids = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id:
                assert c.name and c.index not in calls, c     # the id and the name come once, first
                ids.append(c.id)
                calls[c.index] = [c.name, ""]
            calls[c.index][1] += c.arguments
    return content, reasoning, [(n, a) for n, a in calls.values()], ids


@pytest.mark.parametrize("fmt,text,content,reasoning,calls,markup", REPLIES,
                         ids=[f"{r[0].name}-{i}" for i, r in enumerate(REPLIES)])
def test_reply_is_parsed_whole_and_streamed(fmt, text, content, reasoning, calls, markup):
    msg = parsers.parse(text, syntax(fmt))
    assert (msg.content, msg.reasoning_content) == (content, reasoning)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == calls
    for c in msg.tool_calls:
        json.loads(c.arguments)
    final, deltas = streamed(fmt, text, list(text))
    got_content, got_reasoning, got_calls, ids = joined(deltas)
    assert (got_content, got_reasoning, got_calls) == (content, reasoning, calls)
    assert [c.id for c in final.tool_calls] == ids and len(set(ids)) == len(ids)
    for d in deltas:
        for mark in markup:
            if mark not in content:
                assert mark not in d.content, (mark, d)


def test_arguments_stream_as_fragments_after_the_name():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
    _, deltas = streamed(F.HERMES_2_PRO, text, list(text))
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert len([c for c in calls if c.arguments]) > 10            # the arguments arrive piece by piece
    assert all(not c.id and not c.name for c in calls[1:])


def test_partial_markers_are_held_back():
    s = parsers.ChatStream(syntax(F.HERMES_2_PRO))
    assert s.feed("<thi").content == ""
    d = s.feed("nk>ok</think>Hello <tool_c")
    assert (d.reasoning_content, d.content) == ("ok", "Hello ")
    assert s.feed("alling>").content == "<tool_calling>"         # not a tag after all
    assert s.finish().content == "" and s.message.content == "Hello <tool_calling>"


def test_reasoning_when_the_prompt_opened_it():
    forced = syntax(F.CONTENT_ONLY, thinking_forced_open=True)
    msg = parsers.parse("First I add.\n</think>\n\n4", forced)
    assert (msg.reasoning_content, msg.content) == ("First I add.", "4")
    assert parsers.parse("still thinking", forced).reasoning_content == "still thinking"     # never closed
    plain = parsers.parse("First I add.\n</think>\n\n4", syntax(F.CONTENT_ONLY, thinking_forced_open=True,
                                                                reasoning_format=ReasoningFormat.NONE))
    assert plain.content == "First I add.\n</think>\n\n4" and plain.reasoning_content == ""


def test_cut_or_broken_markup_is_read_as_content():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    msg = parsers.parse(cut, syntax(F.HERMES_2_PRO))
    assert msg.tool_calls == [] and msg.content == cut
    partial = parsers.parse(cut, syntax(F.HERMES_2_PRO), partial=True)
    assert [(c.name, c.arguments) for c in partial.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert parsers.parse('[TOOL_CALLS][{"arguments": {}}]', syntax(F.MISTRAL_NEMO)).tool_calls == []


def test_mistral_ids_have_nine_characters():
    text = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}, "id": "abcdefghi"}}]'
    final, _ = streamed(F.MISTRAL_NEMO, text, [text])
    (call,) = final.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


# ---- prompts ------------------------------------------------------------------------------------

HERMES = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n"
            "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
OPENS_THINK = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
               "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


@pytest.fixture(scope="module")
def vocab():
    return llm.load_model(VOCAB_MODEL, vocab_only=True).vocab


def options(**kw) -> prompt.ChatOptions:
    tools = tool_calls.check_tools(kw.pop("tools")) if "tools" in kw else []
    choice = tool_calls.ToolChoice.parse(kw.pop("tool_choice", "auto"), tools)
    return prompt.ChatOptions(tools=tuple(tools), tool_choice=choice, **kw)


def test_hermes_prompt_renders_tools_calls_and_results(vocab):
    p = prompt.apply(HERMES, HISTORY, options(tools=TOOLS), vocab=vocab)
    assert p.syntax.format == F.HERMES_2_PRO and p.syntax.parse_tool_calls
    assert '"name": "get_weather", "description": "Current weather in a city"' in p.prompt     # tools, keys in order
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>' in p.prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in p.prompt
    assert p.grammar is not None and p.grammar.lazy                      # auto: a call is optional
    required = prompt.apply(HERMES, HISTORY, options(tools=TOOLS, tool_choice="required"), vocab=vocab)
    assert required.grammar is not None and not required.grammar.lazy
    none = prompt.apply(HERMES, HISTORY, options(tools=TOOLS, tool_choice="none"), vocab=vocab)
    assert none.grammar is None and "<tools>" not in none.prompt and not none.syntax.parse_tool_calls


def test_generic_prompt_describes_tools_in_a_system_message(vocab):
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    p = prompt.apply(chatml, HISTORY, options(tools=TOOLS, tool_choice="required"), vocab=vocab)
    assert p.syntax.format == F.GENERIC and p.prompt.startswith("<|im_start|>system\nYou can call these tools")
    assert '{"tool_call": {"name": "get_weather"' in p.prompt and "Tool result: 18 C, sunny" in p.prompt


def test_a_template_that_opens_think_starts_the_reply_inside_it(vocab):
    msgs = [{"role": "user", "content": "2 + 2?"}]
    p = prompt.apply(OPENS_THINK, msgs, options(), vocab=vocab)
    assert p.prompt.endswith("<think>\n") and p.syntax.thinking_forced_open
    off = prompt.apply(OPENS_THINK, msgs, options(enable_thinking=False), vocab=vocab)
    assert off.prompt.endswith("<think>\n</think>") and not off.syntax.thinking_forced_open
    kw_off = prompt.apply(THINKING, msgs, options(chat_template_kwargs={"enable_thinking": False}), vocab=vocab)
    assert kw_off.prompt.endswith("<think>\n\n</think>\n\n") and not kw_off.syntax.thinking_forced_open
    on = prompt.apply(THINKING, msgs, options(), vocab=vocab)
    assert on.syntax.thinking_forced_open


def test_template_kwargs_reach_the_template_but_not_its_own_variables(vocab):
    t = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert prompt.apply(t, [{"role": "user", "content": "x"}], options(chat_template_kwargs={"greeting": "hi "}),
                        vocab=vocab).prompt == "hi x"
    with pytest.raises(ValueError, match="messages"):
        prompt.apply(t, [], options(chat_template_kwargs={"messages": []}), vocab=vocab)


def test_tools_are_checked():
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(tool_calls.ToolError) as e:
        tool_calls.check_tools([WEATHER, bad_schema])
    assert e.value.param == "tools[1].function.parameters"
    with pytest.raises(tool_calls.ToolError) as e:
        tool_calls.ToolChoice.parse({"type": "function", "function": {"name": "nope"}}, TOOLS)
    assert e.value.param == "tool_choice"
    assert tool_calls.ToolChoice.parse({"type": "function", "function": {"name": "get_time"}}, TOOLS) == \
        tool_calls.ToolChoice("required", "get_time")


# ---- grammars -----------------------------------------------------------------------------------

SPECS = [ToolSpec(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
CALLS = {
    F.HERMES_2_PRO: f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
    F.LLAMA_3_X: f'{{"name": "get_weather", "parameters": {ARGS}}}',
    F.MISTRAL_NEMO: f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}, "id": "abcdefghi"}}]',
    F.FIREFUNCTION_V2: f' functools[{{"name": "get_weather", "arguments": {ARGS}}}]',
    F.FUNCTIONARY_V3_2: f"get_weather\n{ARGS}",
    F.FUNCTIONARY_V3_1_LLAMA_3_1: f"<function=get_weather>{ARGS}</function>",
    F.COMMAND_R7B: f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {ARGS}}}]'
                   "<|END_ACTION|>",
    F.GRANITE: f'<|tool_call|>[{{"name": "get_weather", "arguments": {ARGS}}}]',
    F.GPT_OSS: f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}",
}
# (DeepSeek R1's markup spells U+2581, which this SPM vocabulary reads as a space: its grammar is
# only built here, below)
AT_START = (F.LLAMA_3_X, F.FUNCTIONARY_V3_2, F.GPT_OSS)      # formats whose lazy grammar waits at the start only


def run(spec, vocab, text: str) -> tuple[bool, object]:
    """Feed text's tokens through the grammar sampler: whether each was allowed, and the sampler."""
    gv = grammar_vocab(vocab)
    g = spec.sampler(gv)
    for t in gv.tokenizer.tokenize_str(text):        # as the model writes it (no SPM space prefix)
        cur = TokenDataArray.from_logits(np.zeros(vocab.n_tokens, np.float32))
        g.apply(cur)
        if not np.isfinite(cur.logits[t]):
            return False, g
        g.accept(t)
    return True, g


@pytest.mark.parametrize("fmt", list(CALLS))
def test_grammar_takes_the_native_call_and_forces_one_when_required(fmt, vocab):
    required = tool_grammar(fmt, SPECS, required=True, parallel=False, thinking_forced_open=False, vocab=vocab)
    ok, g = run(required, vocab, CALLS[fmt])
    assert ok and g.is_accepting()
    assert not run(required, vocab, "Hello, I cannot.")[0]                      # a call from the first token
    wrong = CALLS[fmt].replace("Paris", "Paris\", \"extra").replace('"c"}', '"kelvin"}')
    assert not run(required, vocab, wrong)[0]                                  # arguments follow the schema
    lazy = tool_grammar(fmt, SPECS, required=False, parallel=True, thinking_forced_open=False, vocab=vocab)
    lead = "" if fmt in AT_START else "Let me look that up. "
    ok, g = run(lazy, vocab, lead + CALLS[fmt])
    assert ok and g.is_accepting() and not g.awaiting
    ok, g = run(lazy, vocab, "Paris is sunny today, no call needed.")           # no trigger: free text
    assert ok and g.awaiting


def test_lazy_grammar_constrains_after_its_trigger(vocab):
    lazy = tool_grammar(F.HERMES_2_PRO, SPECS, required=False, parallel=False, thinking_forced_open=False,
                        vocab=vocab)
    assert not run(lazy, vocab, 'Sure. <tool_call>\n{"name": "get_stock"')[0]   # not one of the tools
    ok, g = run(lazy, vocab, "<think>maybe <tool_call> later</think>fine")      # a trigger inside the reasoning
    assert ok and g.awaiting
    forced = tool_grammar(F.HERMES_2_PRO, SPECS, required=True, parallel=False, thinking_forced_open=True,
                          vocab=vocab)
    assert run(forced, vocab, "</think>\n" + CALLS[F.HERMES_2_PRO])[0]


def test_generic_reply_schema_with_parallel_calls_and_an_answer_schema():
    schema = tool_calls.reply_schema(TOOLS, "auto", parallel=True, response_schema={"type": "integer"})
    import jsonschema
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]}, schema)
    jsonschema.validate({"response": 4}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "four"}, schema)


def test_deepseek_grammar_builds(vocab):
    for required in (True, False):
        spec = tool_grammar(F.DEEPSEEK_R1, SPECS, required=required, parallel=True, thinking_forced_open=False,
                            vocab=vocab)
        assert spec.lazy != required and "<｜tool▁calls▁end｜>" in spec.grammar


def test_tool_grammar_refuses_a_format_without_calls(vocab):
    with pytest.raises(ValueError, match="Content-only"):
        tool_grammar(F.CONTENT_ONLY, SPECS, required=True, parallel=False, thinking_forced_open=False, vocab=vocab)
    assert issubclass(tool_calls.ToolError, GrammarError)


def test_preserved_control_tokens_keep_their_text(vocab):
    from llm.generation.core import GenParams, SeqState
    bos = vocab.bos
    assert vocab.attrs[bos] & llm.vocab.TokenAttr.CONTROL
    kept = SeqState(GenParams(max_tokens=8, preserved_tokens=frozenset({bos})), vocab)
    plain = SeqState(GenParams(max_tokens=8), vocab)
    assert kept.push(bos).text == vocab.texts[bos].decode() and plain.push(bos).text == ""
