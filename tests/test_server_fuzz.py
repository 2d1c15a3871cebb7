"""Issue 35, item 6: a seeded fuzz of the HTTP layer.

One real server (`python -m llm serve` on a tiny synthetic model, 2 slots, --slot-save-path)
gets a few hundred malformed or hostile requests over every route: most are a valid base body
with one field broken, the rest broken JSON, wrong top-level types, deep nesting, bad slot
ids and names, wrong methods and paths. Each must be answered with a 4xx in the API's error
shape {"error": {"message", "type", "param", "code"}}, naming the broken field and showing no
server path. A few hostile but acceptable bodies (a lone surrogate in a prompt, max_tokens
10**30, top_k -5) may also succeed; none may be a 5xx. Afterwards the server is idle (no slot
processing, an empty queue, no KV cells used) and a greedy answer is the one it gave before.
Every failing case is collected and listed in one assertion.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest
from test_server import ROOT, Server
from tiny_model import TinySpec, write_model

from llm import params
from llm.sampling.samplers import SamplingParams

pytestmark = pytest.mark.slow

SEED = 35
N_CASES = 520
N_SLOTS = 2
TIMEOUT = 30.0
NAN, INF = float("nan"), float("inf")
JSON_TYPE = {"content-type": "application/json"}


@dataclass(frozen=True)
class RawJSON:
    """JSON text put into a body as is (deep nesting, invalid UTF-8: what json.dumps will not write)."""

    text: bytes


def encode(v) -> bytes:
    """v as JSON bytes; RawJSON parts verbatim, NaN and Infinity as Python's json writes them."""
    if isinstance(v, RawJSON):
        return v.text
    if isinstance(v, dict):
        return b"{" + b",".join(encode(k) + b":" + encode(x) for k, x in v.items()) + b"}"
    if isinstance(v, list):
        return b"[" + b",".join(encode(x) for x in v) + b"]"
    return json.dumps(v).encode()


def nested(depth: int, open_: bytes, inner: bytes, close: bytes) -> RawJSON:
    return RawJSON(open_ * depth + inner + close * depth)


DEEP_LIST = nested(10_000, b"[", b"", b"]")
DEEP_OBJECT = nested(10_000, b'{"a":', b"1", b"}")
BAD_UTF8 = RawJSON(b'"\xff\xfe"')
SURROGATE_BYTES = RawJSON(b'"\xed\xa0\x80"')      # a lone surrogate written as (invalid) UTF-8
SCHEMA_CYCLE = {"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}
SCHEMA_DEEP = {"type": "json_schema", "json_schema": {
    "name": "x", "schema": nested(3000, b'{"type":"object","properties":{"a":', b'{"type":"string"}', b"}}")}}
SCHEMA_DEEP_ITEMS = {"type": "json_schema", "json_schema": {
    "name": "x", "schema": nested(3000, b'{"type":"array","items":', b'{"type":"string"}', b"}")}}
SCHEMA_200 = {"type": "json_schema", "json_schema": {       # a body JSON reads, a schema deeper than most
    "name": "x", "schema": nested(200, b'{"type":"array","items":', b'{"type":"string"}', b"}")}}
LONG_TEXT = "hi " * 3000         # over a slot's 256 tokens

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SAVE, RESTORE = "/slots/0?action=save", "/slots/0?action=restore"
BASES: dict[str, dict] = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    COMPLETIONS: {"prompt": "hi", "max_tokens": 4, "temperature": 0},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    SAVE: {"filename": "fuzz.bin"},
    RESTORE: {"filename": "fuzz.bin"},
}


@dataclass
class Case:
    """One request and what its answer must be."""

    path: str
    what: str                       # a short description of the body, for the failure list
    content: bytes
    method: str = "POST"
    headers: dict = field(default_factory=lambda: dict(JSON_TYPE))
    param: str | None = None        # the error's `param` must start with this (None: not checked)
    may_succeed: bool = False       # hostile but acceptable: a 2xx is fine too


def bad_values(values: dict[str, list]) -> list[tuple[dict, str]]:
    """(patch, param) for each bad value of each field."""
    return [({name: v}, name) for name, vs in values.items() for v in vs]


def odd(v) -> bool:
    """Whether v holds raw JSON, a lone surrogate or a non-finite number: refused maybe while the
    body is read, before its fields are (so the error's param is not checked)."""
    if isinstance(v, dict):
        return any(odd(k) or odd(x) for k, x in v.items())
    if isinstance(v, list):
        return any(odd(x) for x in v)
    if isinstance(v, str):
        return any("\ud800" <= c <= "\udfff" for c in v)
    return isinstance(v, RawJSON) or (isinstance(v, float) and not math.isfinite(v))


def short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else f"{s[:40]}...({len(s)} chars)"


# ---- the broken fields, per route ---------------------------------------------------------

GENERATION = bad_values({
    "max_tokens": [0, -1, "8", 1.5, True, [8], {"n": 8}],
    "n": [0, -1, N_SLOTS + 1, 10**30, "2", 1.5],
    "stop": [5, [1], [["a"]], {"a": 1}, ["s"] * 17, [None]],
    "logit_bias": [[1], "x", {"abc": 1}, {"99999": 1}, {"-1": 1}, {"1": "x"}, {"1": 1000}, {"1": True},
                   {"1": NAN}, {"1.5": 1}],
    "stream": ["yes", 1, [True]],
    "stream_options": ["x", [1]],
    "cache_prompt": ["yes", 0],
    "speculative": ["nope", 5, True],
    "response_format": ["json", 5, [], {}, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": 5},
                        {"type": "json_schema", "json_schema": {"schema": "x"}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
                        SCHEMA_CYCLE, SCHEMA_DEEP, SCHEMA_DEEP_ITEMS],
    "grammar": [7, [], "", "root ::= (", "root ::= foo", 'root = "a"', "root ::= [a-"],
    "model": [5, "", "nope", "\ud800", SURROGATE_BYTES, "m" * 10_000, ["tiny"]],
    "repeat_penalty": [0],
    "mirostat": [7],
    "min_keep": [-5],
    "temperature": ["hot", INF, -INF],
    "top_k": [INF],
    "samplers": [["nope"]],
}) + [
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"dry_multiplier": 1.0, "dry_sequence_breakers": ["\ud800"]}, "dry_sequence_breakers"),
]

MESSAGES = [[], {}, "hi", [1], [[]], DEEP_LIST, [{"role": "wizard", "content": "x"}], [{"content": "x"}],
            [{"role": "user"}], [{"role": 5, "content": "x"}], [{"role": None, "content": "x"}],
            [{"role": "user", "content": 5}], [{"role": "user", "content": {"text": "hi"}}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": [1]}],
            [{"role": "user", "content": DEEP_LIST}], [{"role": "user", "content": LONG_TEXT}],
            [{"role": "user", "content": "hi"}, "hi"]]

ROUTE_FIELDS: dict[str, list[tuple[dict, str]]] = {
    CHAT: bad_values({
        "messages": MESSAGES,
        "max_completion_tokens": [0, "8"],
        "logprobs": ["yes", 1],
        "top_logprobs": [21, -1, "3", 10**30],
    }) + [({"top_logprobs": 3}, "top_logprobs")],
    COMPLETIONS: bad_values({
        "prompt": [None, [], [[]], [99999], [-1], [1.5], [True], {"a": 1}, 5, DEEP_LIST, [["x", 1]], [10**30],
                   LONG_TEXT, [LONG_TEXT]],
        "logprobs": [-1, 21, "x", True, 10**30],
    }),
    "/v1/embeddings": bad_values({
        "input": [None, [], "", 5, [[]], [["a"]], [-1], [99999], [1.5], {"a": 1}, [True], ["hi", 5],
                  ["hi"] * 3000, [[1] * 300] * 1100, DEEP_LIST, [10**30]],
        "encoding_format": ["hex", 5],
        "model": [5, "nope", "\ud800"],
    }),
    "/tokenize": bad_values({
        "content": [None, 5, [], {}, True, DEEP_LIST],
        "add_special": ["yes", 1],
        "with_pieces": ["yes", 1],
    }),
    "/detokenize": bad_values({
        "tokens": [None, "x", {}, 5, [-1], [99999], [1.5], [True], [[1]], [10**30], DEEP_LIST],
    }),
}
SLOT_NAMES = [None, 5, ["a"], "", ".", "..", "../etc/passwd", "/etc/passwd", "a/b", "a\\b", "c:x", " a", "a\nb",
              "a\x00b", "\ud800", SURROGATE_BYTES, "f" * 255, "f" * 300]
ROUTE_FIELDS[SAVE] = bad_values({"filename": SLOT_NAMES})
ROUTE_FIELDS[RESTORE] = bad_values({"filename": [*SLOT_NAMES, "missing.bin"]})

# hostile bodies the API may accept (2xx) or refuse (4xx), never with a 5xx
MAY_SUCCEED: list[tuple[str, dict]] = [
    (COMPLETIONS, {"prompt": "\ud800"}), (COMPLETIONS, {"prompt": SURROGATE_BYTES}), (COMPLETIONS, {"prompt": ""}),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}), (COMPLETIONS, {"stop": ["\ud800"]}),
    (COMPLETIONS, {"grammar": 'root ::= "\ud800"'}), (COMPLETIONS, {"response_format": SCHEMA_200}),
    (COMPLETIONS, {"max_tokens": 10**30}), (COMPLETIONS, {"top_k": -5}),
    (COMPLETIONS, {"dry_multiplier": 1.0, "dry_allowed_length": -5}),
    (CHAT, {"x_unknown": {"a": [1, "\ud800"]}, "\ud800": 1}), ("/tokenize", {"content": "\ud800"}),
    ("/v1/embeddings", {"input": "\ud800"}), ("/detokenize", {"tokens": []}),
]


def sampler_fields() -> list[tuple[dict, str]]:
    """Wrong types and out-of-range values for every sampler field a request may set (from
    SamplingParams' declarations, as the server reads them)."""
    out = []
    for f, arg in params.fields_of(SamplingParams):
        name, kind = params.name_of(f, arg), type(params.default_of(f))
        if not arg.request or kind is dict:
            continue
        if kind is bool:
            values: list = ["yes", 1, [True]]
        elif kind is int:
            values = ["7", 1.5, True, {"v": 1}, NAN]
        elif kind is float:
            values = ["hot", True, [0.5], {"v": 1}, NAN, INF]
        else:
            values = ["text", [1], [None], [["a"]]] + ([["nope"]] if arg.choices else [])
        if arg.lo is not None:
            values.append(arg.lo - 1)
        if arg.hi is not None:
            values += [arg.hi + 1, 10**30]
        out += [({name: v}, name) for v in values]
    return out


# ---- building the cases --------------------------------------------------------------------

def field_case(rng: random.Random, path: str, patch: dict, param: str | None, may_succeed: bool = False) -> Case:
    """The route's base body with `patch` applied, sometimes with an unknown field and the keys shuffled."""
    body = {**BASES[path], **patch}
    if rng.random() < 0.3:
        body[f"x_fuzz_{rng.randrange(1000)}"] = rng.choice([1, "junk", [1, 2], {"a": None}, 10**30, -1.5])
    items = list(body.items())
    rng.shuffle(items)
    what = ", ".join(f"{k}={short(v)}" for k, v in patch.items())
    return Case(path, what, encode(dict(items)), param=None if odd(patch) else param, may_succeed=may_succeed)


def structural_cases(rng: random.Random, path: str) -> list[Case]:
    """Bodies that are not a JSON object: not JSON, truncated, another type, invalid UTF-8, too deep."""
    base = encode(BASES[path])
    cut = rng.randrange(1, len(base) - 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    form = {"content-type": "application/x-www-form-urlencoded"}
    bodies = [("empty body", b"", None), ("random bytes", junk, None), (f"truncated at {cut}", base[:cut], None),
              ("a list", b"[]", None), ("the body in a list", b"[" + base + b"]", None), ("a string", b'"x"', None),
              ("a number", b"1", None), ("true", b"true", None), ("null", b"null", None), ("NaN", b"NaN", None),
              ("invalid UTF-8", base[:-1] + b',"x":' + BAD_UTF8.text + b"}", None),
              ("10000 nested lists", DEEP_LIST.text, None), ("10000 nested objects", DEEP_OBJECT.text, None),
              ("form-encoded", b"content=hi&prompt=hi&max_tokens=4", form),
              ("text/plain, not JSON", b"hello", {"content-type": "text/plain"})]
    return [Case(path, what, content, headers=headers or dict(JSON_TYPE)) for what, content, headers in bodies]


def route_cases() -> list[Case]:
    """Wrong methods, unknown paths and bad slot ids or actions."""
    body = encode(BASES[COMPLETIONS])
    out = [Case(p, f"{m} {p}", body, method=m) for m, p in [
        ("POST", "/health"), ("POST", "/v1/models"), ("POST", "/slots"), ("GET", CHAT), ("GET", COMPLETIONS),
        ("PUT", "/tokenize"), ("PATCH", "/v1/embeddings"), ("DELETE", "/slots/0"), ("GET", "/slots/0"),
        ("POST", "/v1/nope"), ("POST", "/v1/chat/completion"), ("POST", "/v1/completions/x")]]
    slot_body = encode(BASES[SAVE])
    for slot in ["abc", "-1", "99", "1.5", "0x1", "%00", "%C2%B2", "%D9%A3", "9" * 400, "9" * 5000]:
        out.append(Case(f"/slots/{slot}?action=save", f"slot id {short(slot)}", slot_body, param="id_slot"))
    for action in ["", "delete", "SAVE", "%00", "\u00e9"]:
        out.append(Case(f"/slots/0?action={action}", f"action {action!r}", slot_body, param="action"))
    return out


def cases(seed: int = SEED, n: int = N_CASES) -> list[Case]:
    """Every table entry once (the shared generation and sampler fields on a random one of the two
    generation routes), then random picks of them until there are n."""
    rng = random.Random(seed)
    table = [(path, patch, param) for path, entries in ROUTE_FIELDS.items() for patch, param in entries]
    table += [(rng.choice([CHAT, COMPLETIONS]), patch, param) for patch, param in GENERATION + sampler_fields()]
    out = [field_case(rng, path, patch, param) for path, patch, param in table]
    out += [field_case(rng, path, patch, None, may_succeed=True) for path, patch in MAY_SUCCEED]
    for path in BASES:
        out += structural_cases(rng, path)
    out += route_cases()
    out.append(Case(COMPLETIONS, "9 MiB body", b'{"prompt": "' + b"a" * (9 << 20) + b'"}'))
    while len(out) < n:
        if rng.random() < 0.8:
            out.append(field_case(rng, *rng.choice(table)))
        else:
            out.append(rng.choice(structural_cases(rng, rng.choice(list(BASES)))))
    return out


# ---- checking the answers ------------------------------------------------------------------

def error_problem(r: httpx.Response, case: Case, private: list[str]) -> str | None:
    """What is wrong with a 4xx answer, or None: the API's error shape, the param, no server path."""
    try:
        body = r.json()
    except ValueError:
        return "not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(body) != {"error"} or set(err) != {"message", "type", "param", "code"}:
        return "not the API's error shape"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            and isinstance(err["param"], (str, type(None))) and isinstance(err["code"], (str, type(None)))):
        return "error fields of the wrong types"
    if case.param is not None and not (isinstance(err["param"], str) and err["param"].startswith(case.param)):
        return f"param {err['param']!r}, expected {case.param!r}"
    if any(p in r.text for p in private):
        return "a server path in the error"
    return None


def problem(r: httpx.Response, case: Case, private: list[str]) -> str | None:
    if r.status_code >= 500 or (r.status_code < 400 and not case.may_succeed):
        return f"status {r.status_code}"
    if r.status_code < 400:
        return None
    return error_problem(r, case, private)


def send(url: str, case: Case) -> httpx.Response:
    """One request on its own connection (a 5xx may close a kept-alive one)."""
    return httpx.request(case.method, url + case.path, content=case.content, headers=case.headers,
                         timeout=TIMEOUT)


def greedy(url: str) -> tuple[str, str]:
    """A greedy completion and a greedy chat answer of 8 tokens."""
    c = httpx.post(url + COMPLETIONS, json={"prompt": "The fuzz reference:", "max_tokens": 8, "temperature": 0},
                   timeout=60)
    m = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                                     "temperature": 0}, timeout=60)
    assert c.status_code == 200 and m.status_code == 200, (c.text, m.text)
    return c.json()["choices"][0]["text"], m.json()["choices"][0]["message"]["content"]


def idle_health(url: str, timeout: float = 10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if (h["slots_processing"] == 0 and h["queue"] == 0 and h["kv_cells_used"] == 0) or time.time() > deadline:
            return h
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    model = write_model(d / "tiny.gguf", TinySpec(seed=5))
    slots = d / "slots"
    slots.mkdir()
    s = Server(model, d / "server.log", "-np", str(N_SLOTS), "-c", "512", "--no-warmup",
               "--slot-save-path", str(slots))
    s.private = [str(d), str(ROOT), sys.prefix]
    yield s
    s.stop()


def test_cases_are_seeded_and_cover_every_route():
    a, b = cases(), cases()
    assert [(c.path, c.content) for c in a] == [(c.path, c.content) for c in b]
    assert len(a) >= N_CASES
    assert {c.path for c in a} >= set(BASES)


def test_malformed_bodies_are_4xx_in_the_api_error_shape(server):
    before = greedy(server.url)
    failures = []
    all_cases = cases()
    t0 = time.perf_counter()
    for case in all_cases:
        try:
            r = send(server.url, case)
        except httpx.HTTPError as e:
            failures.append(f"{case.method} {case.path[:60]} [{case.what}]: no answer: {type(e).__name__}: {e}")
            if server.proc.poll() is not None:
                failures.append(f"the server exited: {server.log.read_text()[-1000:]}")
                break
            continue
        p = problem(r, case, server.private)
        if p is not None:
            failures.append(f"{case.method} {case.path[:60]} [{case.what}]: {p}: {r.status_code} {r.text[:200]}")
    elapsed = time.perf_counter() - t0
    health = idle_health(server.url)
    if not (health["status"] == "ok" and health["slots_idle"] == N_SLOTS and health["slots_processing"] == 0
            and health["queue"] == 0 and health["kv_cells_used"] == 0):
        failures.append(f"not idle afterwards: {health}")
    after = greedy(server.url)
    if after != before:
        failures.append(f"the greedy answers changed: {before!r} -> {after!r}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(all_cases)} cases failed ({elapsed:.1f} s):\n" + "\n".join(failures),
                    pytrace=False)
