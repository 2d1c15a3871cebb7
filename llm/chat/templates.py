"""Chat templates: render `tokenizer.chat_template` (Jinja2) safely, with built-in ChatML and
Gemma fallbacks for files that carry none.

Templates come from model files, so they are untrusted code: they render in Jinja2's
ImmutableSandboxedEnvironment with only `raise_exception` and `strftime_now` added, a
deadline checked inside every `range` step, every intercepted operator and every output
chunk, and caps on string/list products and on the output size (llm.chat.sandbox: Jinja2 is
imported on the first render, not by `import llm`)."""
from __future__ import annotations

import time
from dataclasses import dataclass


class ChatTemplateError(ValueError):
    """A template that fails, escapes the sandbox, runs too long or renders too much."""


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant'"
         " else message['role'] %}{% if role == 'system' %}{{ '<start_of_turn>user\n' + message['content']"
         " + '\n\n' }}{% else %}{% if not (loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system') %}"
         "{{ '<start_of_turn>' + role + '\n' }}{% endif %}{{ message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

BUILTIN_TEMPLATES = {"chatml": CHATML, "gemma": GEMMA}


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 1.5         # the deadline; with its checks' granularity, renders end within 2 s
    max_output_chars: int = 1 << 20
    max_product: int = 1 << 20      # longest string/list any one operation may build
    max_built_bytes: int = 128 << 20    # all strings, lists and integers built during one render
    max_int_bits: int = 1 << 16     # largest integer an arithmetic operation may build


class _Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ChatTemplateError(f"chat template took longer than {self.seconds:g} s to render")


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", limits: RenderLimits = RenderLimits(),
           **extra) -> str:
    """Render a chat template for `messages` ([{"role", "content"}, ...])."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    from llm.chat import sandbox
    return sandbox.render(template, messages, deadline=_Deadline(limits.seconds), limits=limits,
                          add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
                          **extra)


def template_for(meta: dict, arch: str) -> str:
    """The model's own template, else a built-in one that fits its architecture."""
    t = meta.get("tokenizer.chat_template")
    if isinstance(t, str) and t.strip():
        return t
    return GEMMA if arch.startswith("gemma") else CHATML
