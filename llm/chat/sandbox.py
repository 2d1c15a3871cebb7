"""The sandbox chat templates render in (llm.chat.templates.render): Jinja2's
ImmutableSandboxedEnvironment with size checks before any string, list or integer is built,
the deadline checked in every `range` step, operator and output chunk. A module of its own so
that Jinja2 (tens of ms) is imported by the first render, not by `import llm`."""
from __future__ import annotations

import datetime
import json
import re
import string
import sys
from functools import update_wrapper

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm.chat.template_limits import ChatTemplateError, Deadline, RenderLimits

# str methods a template may call; those that can grow a string have their arguments
# checked first (`_Env._check_str_method`), everything else on str is refused.
_STR_METHODS = frozenset({
    "capitalize", "casefold", "count", "endswith", "find", "index", "isalnum", "isalpha", "isascii",
    "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle",
    "isupper", "lower", "lstrip", "partition", "removeprefix", "removesuffix", "rfind", "rindex",
    "rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title",
    "upper", "center", "ljust", "rjust", "zfill", "replace", "join", "format", "format_map", "expandtabs",
})
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox plus size checks made before any string, list or integer is built.
    Compiled with the optimizer off: constant folding would run template code (for example
    `'x' | center(3000000000)`) while compiling, before any check or the deadline."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "-", "/", "//"})

    def __init__(self, deadline: Deadline, limits: RenderLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined, optimized=False)
        self.deadline = deadline
        self.limits = limits
        self.built = 0      # bytes of the values built so far (the per-operation caps alone allow many)
        self.code_generator_class = _CodeGenerator
        self._wrap_filters()

    # ---- size checks ----------------------------------------------------------------

    def _check_size(self, n: int, what: str) -> None:
        if n > self.limits.max_product:
            raise ChatTemplateError(f"chat template {what} of {n} items (limit {self.limits.max_product})")

    def _charge(self, value, extra: int = 0):
        """Count what an operation built against the render's budget; returns value."""
        if isinstance(value, (str, int)):
            n = sys.getsizeof(value)
        elif isinstance(value, (list, tuple, dict)):
            n = 8 * len(value)
        else:
            n = 0
        self.built += n + extra
        if self.built > self.limits.max_built_bytes:
            raise ChatTemplateError(f"chat template built more than {self.limits.max_built_bytes >> 20} MB "
                                    f"of values (limit)")
        return value

    def _check_int(self, bits: int, what: str) -> None:
        if bits > self.limits.max_int_bits:
            raise ChatTemplateError(f"chat template {what} a {bits}-bit integer "
                                    f"(limit {self.limits.max_int_bits})")

    def _check_format_spec(self, fmt: str, args, kwargs) -> None:
        """Width and precision fields of a str.format string, any width taken from the
        arguments (`{:{}}`), and the size of the result."""
        values = [*args, *kwargs.values()]
        for _, _, spec, _ in string.Formatter().parse(fmt):
            for n in re.findall(r"\d+", spec or ""):
                self._check_size(int(n), "formats a field")
            if spec and "{" in spec:
                for v in values:
                    if isinstance(v, int):
                        self._check_size(abs(v), "formats a field")
        self._check_size(len(fmt) + sum(len(v) if isinstance(v, str) else 32 for v in values), "formats a string")

    def _check_percent(self, fmt: str, args) -> None:
        for width, prec in _PERCENT_SPEC.findall(fmt):
            for f in (width, prec):
                if f.isdigit():
                    self._check_size(int(f), "formats a field")
        if "*" in fmt:
            for v in (args if isinstance(args, tuple) else (args,)):
                if isinstance(v, int):
                    self._check_size(abs(v), "formats a field")
        vals = args if isinstance(args, tuple) else (args,)
        self._check_size(len(fmt) + sum(len(v) if isinstance(v, str) else 32 for v in vals), "formats a string")

    def _check_str_method(self, s: str, name: str, args: tuple, kwargs: dict) -> tuple:
        """args, with an iterable given to join materialised so it is read only once."""
        if name in ("center", "ljust", "rjust", "zfill"):
            width = args[0] if args else kwargs.get("width", 0)
            if isinstance(width, int):
                self._check_size(width, f"str.{name} builds a string")
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                self._check_size(len(s) + s.count("\t") * max(tab, 0), "str.expandtabs builds a string")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            n = s.count(args[0]) if args[0] else len(s) + 1
            if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                n = min(n, args[2])
            self._check_size(len(s) + n * max(len(args[1]) - len(args[0]), 0), "str.replace builds a string")
        elif name == "join" and args:
            items = list(args[0])
            self._check_size(sum(len(x) for x in items if isinstance(x, str)) + len(s) * len(items),
                             "str.join builds a string")
            args = (items, *args[1:])
        return args

    # ---- what the generated code calls ----------------------------------------------

    def is_safe_attribute(self, obj, attr, value) -> bool:
        if isinstance(obj, str) and callable(value) and attr not in _STR_METHODS:
            return False
        return super().is_safe_attribute(obj, attr, value)

    def wrap_str_format(self, value):
        """str.format / format_map, with widths and output size checked before formatting."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args, **kwargs):
            if is_map:
                self._check_format_spec(fmt, (), args[0] if args and isinstance(args[0], dict) else {})
            else:
                self._check_format_spec(fmt, args, kwargs)
            return wrapper(*args, **kwargs)

        return update_wrapper(checked, value)

    def call_binop(self, context, operator, left, right):
        self.deadline.check()
        seqs = (str, list, tuple)
        if operator == "*":
            if isinstance(left, seqs) != isinstance(right, seqs):
                seq, n = (left, right) if isinstance(left, seqs) else (right, left)
                if isinstance(n, int):
                    self._check_size(len(seq) * n, "builds a sequence")
            elif isinstance(left, int) and isinstance(right, int):
                self._check_int(left.bit_length() + right.bit_length(), "multiplies to")
        if operator == "**" and isinstance(right, (int, float)):
            if abs(right) > 1024:
                raise ChatTemplateError(f"chat template raises to the power {right}")
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                self._check_int(max(left.bit_length(), 1) * right, "raises to")
        if operator == "+" and isinstance(left, (str, list)) and isinstance(right, type(left)):
            if len(left) + len(right) > self.limits.max_output_chars:
                raise ChatTemplateError("chat template builds a string beyond the output limit")
        if operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return self._charge(super().call_binop(context, operator, left, right))

    def call_concat(self, values: tuple) -> str:
        """`a ~ b ~ c`, with its length checked as each operand is converted."""
        self.deadline.check()
        parts = []
        size = 0
        for v in values:
            s = v if isinstance(v, str) else str(v)
            size += len(s)
            if size > self.limits.max_output_chars:
                raise ChatTemplateError("chat template builds a string beyond the output limit")
            parts.append(s)
        return self._charge("".join(parts))

    def call(self, context, obj, *args, **kwargs):
        self.deadline.check()
        owner = getattr(obj, "__self__", None)
        extra = 0
        if isinstance(owner, str):      # any str method builds at most about len(owner) more
            args = self._check_str_method(owner, obj.__name__, args, kwargs)
            extra = sys.getsizeof(owner)
        return self._charge(super().call(context, obj, *args, **kwargs), extra)

    def _wrap_filters(self) -> None:
        """Check the width, count and format arguments of the filters that grow strings."""
        f = dict(self.filters)
        env = self

        def center(value, width=80):
            env._check_size(int(width) if isinstance(width, int) else 0, "filter center builds a string")
            return f["center"](value, width)

        def indent(s, width=4, first=False, blank=False):
            w = len(width) if isinstance(width, str) else width
            text = str(s)
            if isinstance(w, int):
                env._check_size(len(text) + (text.count("\n") + 1) * max(w, 0), "filter indent builds a string")
            return f["indent"](s, width, first, blank)

        def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
            text = str(s)
            sep = wrapstring if isinstance(wrapstring, str) else "\n"
            if isinstance(width, int):
                lines = len(text) // max(width, 1) + text.count(" ") + 1
                env._check_size(len(text) + lines * len(sep), "filter wordwrap builds a string")
            return f["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)

        def format_(value, *args, **kwargs):
            env._check_percent(str(value), tuple(args) if args else kwargs)
            return f["format"](value, *args, **kwargs)

        def join(eval_ctx, value, d="", attribute=None):
            items = list(value)
            env._check_size(sum(len(x) if isinstance(x, str) else 32 for x in items)
                            + len(str(d)) * len(items), "filter join builds a string")
            return f["join"](eval_ctx, items, d, attribute)

        def replace(eval_ctx, s, old, new, count=None):
            text, o, n = str(s), str(old), str(new)
            k = text.count(o) if o else len(text) + 1
            if isinstance(count, int) and count >= 0:
                k = min(k, count)
            env._check_size(len(text) + k * max(len(n) - len(o), 0), "filter replace builds a string")
            return f["replace"](eval_ctx, s, old, new, count)

        def truncate(environment, s, length=255, killwords=False, end="...", leeway=None):
            env._check_size(len(str(end)), "filter truncate builds a string")
            return f["truncate"](environment, s, length, killwords, end, leeway)

        for new in (wordwrap, join, replace, truncate):     # keeps jinja_pass_arg (environment, eval context)
            update_wrapper(new, f[new.__name__])
        self.filters.update(center=center, indent=indent, wordwrap=wordwrap, format=format_, join=join,
                            replace=replace, truncate=truncate, tojson=_tojson)
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._charged(fn)

    def _charged(self, fn):
        """A filter whose result (and the strings it read) count against the budget."""
        env = self

        def charged(*args, **kwargs):
            env.deadline.check()
            extra = sum(sys.getsizeof(a) for a in args if isinstance(a, str))
            return env._charge(fn(*args, **kwargs), extra)

        return update_wrapper(charged, fn)      # copies jinja_pass_arg too


class _CodeGenerator(CodeGenerator):
    """Routes `~` through `environment.call_concat`, which checks the size."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.call_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' tojson, which chat templates are written for: keys in their order, no HTML
    escapes (Jinja2's own sorts keys and writes `<` as \\u003c, which changes tool schemas and calls)."""
    if isinstance(indent, (int, str)) and not isinstance(indent, bool) and len(str(indent)) > 2:
        raise ChatTemplateError(f"chat template asks tojson for an indent of {str(indent)[:20]!r} (at most 99)")
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        raise ChatTemplateError(f"chat template's tojson failed: {e}") from None


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def render(template: str, messages: list[dict], *, deadline: Deadline, limits: RenderLimits,
           add_generation_prompt: bool, bos_token: str, eos_token: str, **extra) -> str:
    """llm.chat.templates.render's work, the messages checked: the template compiled in the
    sandbox and rendered under the deadline and limits."""
    env = _Env(deadline, limits)
    env.globals.pop("lipsum", None)

    def checked_range(*args):
        if len(args) > 3:
            raise ChatTemplateError("range() takes at most 3 arguments")
        r = range(*args)
        if len(r) > limits.max_product:
            raise ChatTemplateError(f"chat template asks for a range of {len(r)} numbers (limit {limits.max_product})")
        for i in r:
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
