"""Chat template rendering: exact ChatML / Gemma text and the sandbox's limits."""
import time
from pathlib import Path

import pytest

from llm.chat import templates as chat

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
@pytest.mark.slow
def test_hostile_templates_fail_fast_with_clear_error(template, match):
    t0 = time.monotonic()
    with pytest.raises(chat.ChatTemplateError, match=match):
        chat.render(template, MSGS, limits=chat.RenderLimits(seconds=1.0))
    assert time.monotonic() - t0 < 5.0


def test_bad_messages_rejected():
    with pytest.raises(chat.ChatTemplateError, match=r"messages\[0\]"):
        chat.render(chat.CHATML, [{"role": "user"}])


BOMBS = [
    "{% set s = 'x' | center(3000000000) %}{{ s }}",
    "{{ 'x'.ljust(3000000000) }}",
    "{{ '%3000000000d' % 1 }}",
    "{{ '%*d' % (3000000000, 1) }}",
    "{{ '{:>3000000000}'.format(1) }}",
    "{{ '{:>{}}'.format(1, 3000000000) }}",
    "{{ '{0:>3000000000}'.format_map({}) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x' | indent(3000000000) }}",
    "{{ ('x' * 1000) | replace('x', 'y' * 100000) }}",
    "{{ 'x'.replace('', 'y' * 1000000) }}",
    "{{ ','.join(['x' * 100000] * 100) }}",
    "{{ (['x' * 100000] * 100) | join(',') }}",
    "{{ 'a\tb'.expandtabs(3000000000) }}",
    "{{ 'x'.zfill(3000000000) }}",
    "{{ '%3000000000s' | format('a') }}",
    "{{ 'abc' | truncate(2, end='x' * 3000000) }}",
    "{{ ((10 ** 1000) ** 1000) ** 1000 }}",
    "{% set ns = namespace(n=10 ** 100) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{{ 'x'.translate({120: 'yy'}) }}",
    # each step is small; what they keep adds up
    "{% set s = 'x' * 1000000 %}{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + [s | upper] %}{% endfor %}",
    "{% set ns = namespace(l=[]) %}{% for i in range(1000000) %}{% set ns.l = ns.l + [10 ** 1000 - i] %}{% endfor %}",
    "{{ range(100000000) | list | length }}",
]

_BOMB_CHILD = r"""
import json, resource, sys, time
from llm.chat import templates as chat
from llm.model import load_model
paths = json.loads(sys.argv[1])
vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, vm + 256 * 2**20))
out = []
for p in paths:
    model = load_model(p, vocab_only=True)
    t0 = time.monotonic()
    try:
        chat.render(chat.template_for(model.meta, model.arch), [{"role": "user", "content": "hi"}])
        err = None
    except chat.ChatTemplateError as e:
        err = str(e)
    out.append([err, time.monotonic() - t0])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_template_bombs_in_a_gguf_stay_under_256mb_and_2s(tmp_path):
    """Each bomb, read from a model file, fails with a limit error under an address-space
    limit of 256 MB above the interpreter's own, in under 2 s (main folded `center` at
    compile time and allocated gigabytes)."""
    import json
    import os
    import subprocess
    import sys

    import tiny_model
    spec = tiny_model.TinySpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    kv, tensors = tiny_model.model_kv(spec), tiny_model.model_tensors(spec)
    paths = []
    for i, t in enumerate(BOMBS):
        paths.append(str(tiny_model.write_gguf(tmp_path / f"bomb{i}.gguf", {**kv, "tokenizer.chat_template": t},
                                               tensors)))
    r = subprocess.run([sys.executable, "-c", _BOMB_CHILD, json.dumps(paths)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 0, r.stderr[-2000:]
    for template, (err, seconds) in zip(BOMBS, json.loads(r.stdout), strict=True):
        assert err is not None and ("limit" in err or "unsafe" in err or "longer than" in err), (template, err)
        assert "MemoryError" not in err, (template, err)
        assert seconds < 2.0, (template, seconds)
