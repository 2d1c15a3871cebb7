"""Chat template rendering: exact ChatML / Gemma text and the sandbox's limits."""
import time

import pytest

from llm import chat

MSGS = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_smollm2_template_two_messages_exact():
    out = chat.render(SMOLLM2_TEMPLATE, MSGS, add_generation_prompt=True)
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_builtin_chatml_and_gemma():
    assert chat.render(chat.CHATML, MSGS[:1]) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    g = chat.render(chat.GEMMA, [{"role": "system", "content": "Be brief."}] + MSGS, bos_token="<bos>")
    assert g == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
                 "<start_of_turn>model\n4.<end_of_turn>\n<start_of_turn>model\n")


def test_template_for_falls_back_by_arch():
    assert chat.template_for({}, "gemma3") == chat.GEMMA
    assert chat.template_for({}, "llama") == chat.CHATML
    assert chat.template_for({"tokenizer.chat_template": "x"}, "llama") == "x"


def test_strftime_and_raise_exception():
    assert len(chat.render("{{ strftime_now('%Y') }}", MSGS)) == 4
    with pytest.raises(chat.ChatTemplateError, match="raised: bad role"):
        chat.render("{{ raise_exception('bad role') }}", MSGS)


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__.__mro__ }}", "sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ cycler.__init__.__globals__ }}", "sandbox"),
    ("{{ 'a' * 10000000000 }}", "sequence of"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "output limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
    ("{% for i in range(1000000) %}{{ 'x' * 1000 }}{% endfor %}", "exceeds|longer than"),
    ("{{ messages[5]['content'] + 1 }}", "failed|error"),
])
def test_hostile_templates_fail_fast_with_clear_error(template, match):
    t0 = time.monotonic()
    with pytest.raises(chat.ChatTemplateError, match=match):
        chat.render(template, MSGS, limits=chat.RenderLimits(seconds=1.0))
    assert time.monotonic() - t0 < 5.0


def test_bad_messages_rejected():
    with pytest.raises(chat.ChatTemplateError, match=r"messages\[0\]"):
        chat.render(chat.CHATML, [{"role": "user"}])
