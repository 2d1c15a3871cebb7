"""Chat templates: render `tokenizer.chat_template` (Jinja2) safely, with built-in ChatML and
Gemma fallbacks for files that carry none.

Templates come from model files, so they are untrusted code: they render in Jinja2's
ImmutableSandboxedEnvironment with only `raise_exception` and `strftime_now` added, a
deadline checked inside every `range` step, every intercepted operator and every output
chunk, and caps on string/list products and on the output size (llm.chat.sandbox: Jinja2 is
imported on the first render, not by `import llm`)."""
from __future__ import annotations

from llm.chat.template_limits import ChatTemplateError, Deadline, RenderLimits

__all__ = ["BUILTIN_TEMPLATES", "CHATML", "GEMMA", "ChatTemplateError", "RenderLimits", "render", "template_for"]


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant'"
         " else message['role'] %}{% if role == 'system' %}{{ '<start_of_turn>user\n' + message['content']"
         " + '\n\n' }}{% else %}{% if not (loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system') %}"
         "{{ '<start_of_turn>' + role + '\n' }}{% endif %}{{ message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

BUILTIN_TEMPLATES = {"chatml": CHATML, "gemma": GEMMA}


_LIMITS = RenderLimits()


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", limits: RenderLimits = _LIMITS,
           **extra) -> str:
    """Render a chat template for `messages` ([{"role", "content"}, ...])."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    from llm.chat import sandbox
    return sandbox.render(template, messages, deadline=Deadline(limits.seconds), limits=limits,
                          add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
                          **extra)


def template_for(meta: dict, arch: str) -> str:
    """The model's own template, else a built-in one that fits its architecture."""
    t = meta.get("tokenizer.chat_template")
    if isinstance(t, str) and t.strip():
        return t
    return GEMMA if arch.startswith("gemma") else CHATML
