"""Chat templates: render `tokenizer.chat_template` (Jinja2) safely, with built-in ChatML and
Gemma fallbacks for files that carry none.

Templates come from model files, so they are untrusted code: they render in Jinja2's
ImmutableSandboxedEnvironment with only `raise_exception` and `strftime_now` added, a
deadline checked inside every `range` step, every intercepted operator and every output
chunk, and caps on string/list products and on the output size."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
    seconds: float = 2.0
    max_output_chars: int = 1 << 20
    max_product: int = 1 << 20      # longest string/list a `*` may build


class _Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ChatTemplateError(f"chat template took longer than {self.seconds:g} s to render")


class _Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, deadline: _Deadline, limits: RenderLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        self.deadline = deadline
        self.limits = limits

    def call_binop(self, context, operator, left, right):
        self.deadline.check()
        if operator == "*" and isinstance(left, (str, list, tuple)) != isinstance(right, (str, list, tuple)):
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(n, int) and len(seq) * n > self.limits.max_product:
                raise ChatTemplateError(f"chat template builds a sequence of {len(seq) * n} items "
                                        f"(limit {self.limits.max_product})")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise ChatTemplateError(f"chat template raises to the power {right}")
        if operator == "+" and isinstance(left, (str, list)) and isinstance(right, type(left)):
            if len(left) + len(right) > self.limits.max_output_chars:
                raise ChatTemplateError("chat template builds a string beyond the output limit")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, *args, **kwargs):
        self.deadline.check()
        return super().call(context, obj, *args, **kwargs)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", limits: RenderLimits = RenderLimits(),
           **extra) -> str:
    """Render a chat template for `messages` ([{"role", "content"}, ...])."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    deadline = _Deadline(limits.seconds)
    env = _Env(deadline, limits)
    env.globals.pop("lipsum", None)

    def checked_range(*args):
        if len(args) > 3:
            raise ChatTemplateError("range() takes at most 3 arguments")
        for i in range(*args):
            deadline.check()
            yield i

    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, range=checked_range)
    try:
        tmpl = env.from_string(template)
        out: list[str] = []
        size = 0
        for chunk in tmpl.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token, **extra):
            deadline.check()
            size += len(chunk)
            if size > limits.max_output_chars:
                raise ChatTemplateError(f"chat template output exceeds {limits.max_output_chars} characters")
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried to leave the sandbox: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def template_for(meta: dict, arch: str) -> str:
    """The model's own template, else a built-in one that fits its architecture."""
    t = meta.get("tokenizer.chat_template")
    if isinstance(t, str) and t.strip():
        return t
    return GEMMA if arch.startswith("gemma") else CHATML
