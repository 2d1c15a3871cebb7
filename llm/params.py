"""One declaration per parameter, as llama.cpp's `common/arg.cpp` binds each flag to a params field.

A field of `SamplingParams`, `ContextParams` or `GenParams` is declared with `param(...)`: its
default, its llama.cpp command-line flags, the keyword / request-field name (llama-server's JSON
name), its bounds and its help. From these fields alone come the CLI's flags (`add_arguments`,
`from_namespace`), the keyword arguments of `LLM`, `LLM.generate` and `Context`
(`from_kwargs`, `keyword_parameters`) and the server's request fields (`from_json`), so a default
or a range is written once.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Arg:
    """What a params field says about itself (see the module docstring)."""

    help: str
    flags: tuple[str, ...] = ()       # command-line flags, llama.cpp's spelling; () = not a flag
    name: str = ""                    # keyword argument and request field; "" = the field's name
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None   # one flag value -> the field's value (else the field's type)
    append: bool = False              # the flag may be repeated; each one adds an item (a tuple field)
    request: bool = True              # a server request field


def param(default: Any = MISSING, *, default_factory: Any = MISSING, help: str, **arg: Any) -> Any:
    """A dataclass field that carries its Arg (keyword arguments as Arg's)."""
    meta = {"arg": Arg(help=help, **arg)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class ParamError(ValueError):
    """A parameter with a wrong type or out of its range; `name` is the keyword / request field."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def fields_of(cls: type) -> Iterator[tuple[Field, Arg]]:
    """The declared fields of a params dataclass, in order."""
    for f in dataclasses.fields(cls):
        arg = f.metadata.get("arg")
        if arg is not None:
            yield f, arg


def name_of(f: Field, arg: Arg) -> str:
    return arg.name or f.name


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The class's annotations evaluated, once per class: get_type_hints compiles every string
    annotation of the class on each call (building the CLI's parser made 2127 such compiles, 60
    of its 83 ms; the server checks each request's fields with them)."""
    return typing.get_type_hints(cls)


def _kind(cls: type, f: Field) -> Any:
    """The field's value type, without `| None`."""
    hint = _hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint


def _optional(cls: type, f: Field) -> bool:
    hint = _hints(cls)[f.name]
    return type(None) in typing.get_args(hint)


# ---- values: checked the same way from every surface -----------------------------------------

def coerce(cls: type, f: Field, arg: Arg, v: Any) -> Any:
    """v as the field's type and within its range; ParamError naming the parameter otherwise."""
    name = name_of(f, arg)
    if v is None:
        if _optional(cls, f):
            return None
        raise ParamError(name, f"'{name}' must not be null")
    kind = _kind(cls, f)
    origin = typing.get_origin(kind) or kind
    if kind is bool:
        if not isinstance(v, bool):
            raise ParamError(name, f"'{name}' must be a boolean, got {_show(v)}")
        return v
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ParamError(name, f"'{name}' must be an integer, got {_show(v)}")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ParamError(name, f"'{name}' must be a number, got {_show(v)}")
        v = float(v)
    elif kind is str:
        if not isinstance(v, str):
            raise ParamError(name, f"'{name}' must be a string, got {_show(v)}")
        if arg.choices and v not in arg.choices:
            raise ParamError(name, f"'{name}' must be one of {', '.join(arg.choices)}; got {v!r}")
    elif origin is tuple:
        item = typing.get_args(kind)[0]
        if isinstance(v, str) or not isinstance(v, (list, tuple)) \
                or not all(isinstance(s, item) and not isinstance(s, bool) for s in v):
            raise ParamError(name, f"'{name}' must be a list of {item.__name__}s, got {_show(v)}")
        if arg.choices and (bad := [s for s in v if s not in arg.choices]):
            raise ParamError(name, f"'{name}': unknown {bad[0]!r}; expected items of {', '.join(arg.choices)}")
        return tuple(v)
    elif origin is dict:
        return _int_float_map(name, v)
    if (arg.lo is not None and v < arg.lo) or (arg.hi is not None and v > arg.hi):
        rng = f">= {arg.lo}" if arg.hi is None else f"<= {arg.hi}" if arg.lo is None else f"in [{arg.lo}, {arg.hi}]"
        raise ParamError(name, f"'{name}' must be {rng}, got {v}")
    return v


def _int_float_map(name: str, v: Any) -> dict[int, float]:
    """{token id: bias}: keys may be ints or strings of ints (JSON object keys are strings)."""
    if not isinstance(v, dict):
        raise ParamError(name, f"'{name}' must be an object mapping token ids to numbers, got {_show(v)}")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            key = int(k)
        except (TypeError, ValueError):
            raise ParamError(name, f"'{name}' key {k!r} is not a token id") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b):
            raise ParamError(name, f"'{name}' value for {k} must be a number, got {_show(b)}")
        out[key] = float(b)
    return out


def _show(v: Any) -> str:
    try:
        return json.dumps(v)[:50]
    except (TypeError, ValueError):
        return repr(v)[:50]


def check(obj: Any) -> None:
    """Every declared field of obj has its type and lies in its range (ParamError otherwise)."""
    cls = type(obj)
    for f, arg in fields_of(cls):
        setattr(obj, f.name, coerce(cls, f, arg, getattr(obj, f.name)))


# ---- keyword arguments (LLM, LLM.generate, Context) ----------------------------------------

def names(cls: type) -> dict[str, Field]:
    """keyword / request name -> field."""
    return {name_of(f, arg): f for f, arg in fields_of(cls)}


def from_kwargs(cls: type[T], kwargs: dict[str, Any], *, where: str, base: T | None = None) -> T:
    """cls from keyword arguments named as its fields' names (None: the default); a name it does
    not declare is a TypeError naming it and the closest ones."""
    table = names(cls)
    values = {}
    for k, v in kwargs.items():
        f = table.get(k)
        if f is None:
            close = difflib.get_close_matches(k, table, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TypeError(f"{where}() got an unexpected keyword argument {k!r}{hint}")
        if v is not None:
            values[f.name] = coerce(cls, f, f.metadata["arg"], v)
    obj = dataclasses.replace(base, **values) if base is not None else cls(**values)  # type: ignore[type-var]
    return obj


def keyword_parameters(cls: type) -> list[inspect.Parameter]:
    """The declared fields as keyword-only parameters with their defaults (for __signature__)."""
    hints = _hints(cls)
    return [inspect.Parameter(name_of(f, arg), inspect.Parameter.KEYWORD_ONLY, default=default_of(f),
                              annotation=hints[f.name]) for f, arg in fields_of(cls)]


def with_parameters(*classes: type, drop: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: the function's signature shows the fields of `classes` as keyword arguments in
    place of its `**kwargs` (which it passes to from_kwargs), so help() and IDEs list them."""
    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        extra = [p for cls in classes for p in keyword_parameters(cls) if p.name not in taken and p.name not in drop]
        fn.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
        return fn
    return wrap


# ---- the command line ------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                  only: tuple[str, ...] | None = None) -> None:
    """One flag per declared field that has flags (`only`: just these field names)."""
    for f, arg in fields_of(cls):
        if not arg.flags or (only is not None and f.name not in only):
            continue
        default = default_of(f)
        kind = _kind(cls, f)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(arg, default)}
        if arg.metavar or kind in (int, float):
            kw["metavar"] = arg.metavar or "N"
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif arg.append:
            kw.update(action="append", type=arg.parse or str, default=None)
        else:
            kw["type"] = arg.parse or (kind if kind in (int, float, str) else str)
            if arg.choices and kind is str:
                kw["choices"] = arg.choices
        parser.add_argument(*arg.flags, **kw)


def _help(arg: Arg, default: Any) -> str:
    """The help line with the default (argparse fills in %(default)s, so set_defaults shows)."""
    if isinstance(default, tuple):
        shown = (";".join(default) if default else "none").encode("unicode_escape").decode()
    elif isinstance(default, dict):
        shown = "none"
    else:
        return arg.help.replace("%", "%%") + " (default: %(default)s)"
    return f"{arg.help} (default: {shown})".replace("%", "%%")


def from_namespace(cls: type[T], ns: argparse.Namespace, **extra: Any) -> T:
    """cls from parsed flags (fields without flags keep their defaults, or take `extra`)."""
    values = dict(extra)
    for f, arg in fields_of(cls):
        if not arg.flags or f.name not in vars(ns):
            continue
        v = getattr(ns, f.name)
        if arg.append:
            if v is None:
                continue
            if all(isinstance(group, dict) for group in v):
                v = {k: b for group in v for k, b in group.items()}
            else:
                v = tuple(item for group in v for item in (group if isinstance(group, tuple) else (group,)))
        flag = arg.flags[0]
        try:
            values[f.name] = coerce(cls, f, arg, v)
        except ParamError as e:
            raise ParamError(flag, str(e).replace(f"'{name_of(f, arg)}'", flag)) from None
    return cls(**values)


# ---- server request fields -------------------------------------------------------------------

def from_json(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    """{field name: value} for the request fields of cls present (not null) in body, checked."""
    out = {}
    for f, arg in fields_of(cls):
        if not arg.request:
            continue
        v = body.get(name_of(f, arg))
        if v is not None:
            out[f.name] = coerce(cls, f, arg, v)
    return out


def request_defaults(cls: type) -> dict[str, Any]:
    """{request field: default} of cls (what a request that leaves them out gets)."""
    return {name_of(f, arg): default_of(f) for f, arg in fields_of(cls) if arg.request}


# ---- the server's settings -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ServerTimeouts:
    """The HTTP server's read timeouts in seconds (`serve` flags; llm.serving.protocol and
    llm.serving.requests.read_json apply them). Declared here, not with the server, so that the
    command line builds without the `server` extra installed."""

    timeout: float = param(600.0, flags=("-to", "--timeout"), lo=0.001, request=False,
                           help="seconds a request body may go without data before the request is a 408 "
                                "(llama-server's read timeout)")
    header_timeout: float = param(60.0, flags=("--timeout-header",), lo=0.001, request=False,
                                  help="seconds a connection has to send a complete request head, after "
                                       "connecting or after its previous response")


@dataclasses.dataclass(frozen=True)
class ServerEndpoints:
    """The server's optional routes (`serve` flags, llama-server's): Prometheus metrics at
    GET /metrics (off by default, as there), the chat page at / (on) and /rerank on a model
    whose GGUF pooling type is not rank (off)."""

    metrics: bool = param(False, flags=("--metrics",), request=False,
                          help="answer GET /metrics (Prometheus text, llama-server's metric names)")
    webui: bool = param(True, flags=("--webui",), request=False,
                        help="serve the chat page at / (--no-webui: / is a 404)")
    reranking: bool = param(False, flags=("--reranking", "--rerank"), request=False,
                            help="answer /rerank with the model's classifier head even when its pooling type is "
                                 "not 'rank' (a model whose pooling is 'rank' reranks without it)")


@dataclasses.dataclass(frozen=True)
class ReasoningParams:
    """The server's reasoning settings (`serve` flags, llama-server's names): where a reply's
    thinking goes, and whether the model may think. A request's own `reasoning_format` and
    `chat_template_kwargs` ({"enable_thinking": false}) override them."""

    reasoning_format: str = param("auto", flags=("--reasoning-format",), choices=("none", "deepseek", "auto"),
                                  request=False,
                                  help="none: thinking stays in message.content; deepseek / auto: it goes to "
                                       "message.reasoning_content (and delta.reasoning_content)")
    reasoning_budget: int = param(-1, flags=("--reasoning-budget",), lo=-1, hi=0, request=False,
                                  help="-1: think without limit; 0: no thinking (the template gets "
                                       "enable_thinking false, an opened think block is closed)")


@dataclasses.dataclass(frozen=True)
class ServerGeneration:
    """How the server's slots generate (`serve` flags, llama-server's names): the names its
    model answers to, context shift in a full slot, and speculative decoding for every request
    (a draft model, with a context of its own per slot, or prompt lookup)."""

    alias: str | None = param(None, flags=("-a", "--alias"), metavar="STRING", request=False,
                              help="names the API also accepts for the model, comma-separated; the first is the "
                                   "name it reports")
    context_shift: bool = param(False, flags=("--context-shift",), request=False,
                                help="when a slot is full, discard half of its tokens after n_keep and go on "
                                     "(else the sample ends with finish reason length)")
    draft_model: str | None = param(None, flags=("-md", "--model-draft", "--draft-model", "--spec-draft-model"),
                                    metavar="FNAME", request=False,
                                    help="a smaller model with the same vocabulary that drafts tokens for every "
                                         "request (speculative decoding; a context of its own per slot)")
    spec_draft_n_max: int = param(16, flags=("--spec-draft-n-max",), lo=1, request=False,
                                  help="the longest draft verified in one step")
    lookup: bool = param(False, flags=("--lookup",), request=False,
                         help="prompt-lookup decoding for every request without a draft model: drafts are the "
                              "tokens that followed the latest match of the last n-gram in the prompt and output")

    def aliases(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in (self.alias or "").split(",") if a.strip())


@dataclasses.dataclass(frozen=True)
class MediaParams:
    """Images in (llm.mtmd): the vision projector of a multimodal model (`generate` and `serve`
    flags, llama.cpp's -mm / --mmproj), and whether the server fetches image_url parts that are
    http(s) URLs (off: only data URLs are read; llama-server's own default fetches them)."""

    mmproj: str | None = param(None, flags=("-mm", "--mmproj"), metavar="FNAME", request=False,
                               help="the vision projector (mmproj GGUF) of a multimodal model, as llama-mtmd-cli "
                                    "and llama-server")
    allow_remote_media: bool = param(False, flags=("--allow-remote-media",), request=False,
                                     help="let image_url parts name http(s) URLs, fetched by the server (at most "
                                          "10 MiB in 10 s); without it they are a 400")
