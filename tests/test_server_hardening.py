"""Issue 35 (server hardening, round two), first part: a request that passes the field checks but
cannot run (a sampler value llama.cpp's samplers refuse, a JSON schema llguidance cannot run) is
refused at admission with a 4xx on its own, and the server goes on; `grammar` (GBNF) is taken in
request bodies as llama-server takes it.

Then the limits (item 4), each attack over real HTTP (uvicorn in a thread, the serve command's
protocol, 1 s timeouts) answered with a 4xx in the API's error shape, the server healthy after:
JSON nesting depth, lone surrogates, schema depth, prompt bytes before tokenizing, slow request
heads and bodies, server paths in error bodies, links and long names in the slot directory."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient
from tiny_model import TinySpec, write_model

import llm
from llm import state
from llm.errors import GrammarError, StateError
from llm.params import ServerTimeouts
from llm.sampling import structured
from llm.serving import Engine
from llm.serving.app import create_app
from llm.serving.protocol import header_timeout_protocol
from llm.serving.requests import (
    MAX_JSON_DEPTH,
    APIError,
    check_json,
    max_token_bytes,
    min_tokens,
    scrub_paths,
)

CYCLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/a",
                                                                        "$defs": {"a": {"$ref": "#/$defs/a"}}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model and its engine (2 slots of 256 tokens), shared by the in-process client and
    the real HTTP server."""
    m = llm.LLM(write_model(tmp_path_factory.mktemp("h") / "tiny.gguf", TinySpec(seed=5)), n_ctx=512, n_seq_max=2)
    engine = Engine(m.ctx, m.vocab, n_slots=2).start()
    yield m, engine
    engine.stop()


@pytest.fixture(scope="module")
def client(served):
    m, engine = served
    with TestClient(create_app(m, engine, model_name="tiny")) as c:
        yield c


@pytest.mark.slow
def test_grammar_in_the_body_constrains_the_output(client):
    for seed in (0, 1, 2):
        r = client.post("/v1/completions", json={"prompt": "answer:", "max_tokens": 8, "temperature": 1.0,
                                                 "seed": seed, "grammar": 'root ::= "yes" | "no"'})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"grammar": 7}, "grammar"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ({"response_format": CYCLE}, "response_format"),
])
def test_a_constraint_that_cannot_run_is_a_400(client, body, param):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.slow
def test_requests_refused_at_admission_leave_the_server_serving(client):
    bad = [{"repeat_penalty": 0}, {"response_format": CYCLE}] * 12     # more than the queue holds
    for b in bad:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, **b})
        assert r.status_code == 400, r.text
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0.0})
    assert r.status_code == 200, r.text
    health = client.get("/health").json()
    assert health["queue"] == 0 and health["slots_processing"] == 0 and health["kv_cells_used"] == 0


@pytest.mark.slow
def test_embedding_inputs_are_limited(client):
    r = client.post("/v1/embeddings", json={"input": ["hello"] * 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "at most 2048" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"input": [[1] * 200] * 2000})
    assert r.status_code == 400 and "more than 300000 tokens" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"input": ["hello", "world"]})
    assert r.status_code == 200, r.text


# ---- limits (issue 35, item 4) --------------------------------------------------------------

TIMEOUT_S = 1.0     # the HTTP server's header and body timeouts here


class HTTPServer:
    """The app on a real socket: uvicorn in a thread with the serve command's protocol class."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", http=header_timeout_protocol(TIMEOUT_S))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def post(self, path: str, body, **kw) -> httpx.Response:
        """POST a JSON body given as an object or as raw bytes (for what json= cannot spell)."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60, **kw)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def http(served, tmp_path_factory):
    m, engine = served
    slots = tmp_path_factory.mktemp("slots")
    app = create_app(m, engine, model_name="tiny", slot_save_path=slots,
                     timeouts=ServerTimeouts(timeout=TIMEOUT_S, header_timeout=TIMEOUT_S))
    server = HTTPServer(app)
    server.slots_dir = slots
    yield server
    server.stop()


def api_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    """The error's message, after checking the status and the error object's shape and fields."""
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e["message"]


def assert_healthy(server: HTTPServer) -> None:
    """GET /health is ok with nothing queued or running, and a normal request is answered."""
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0.0})
    assert r.status_code == 200, r.text
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["queue"] == 0 and health["slots_processing"] == 0


def nested(depth: int, leaf=0):
    """A list nested `depth` levels deep, built without recursion."""
    x = leaf
    for _ in range(depth):
        x = [x]
    return x


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# -- pure functions ----------------------------------------------------------------------------

def test_check_json_bounds_the_depth_without_recursion():
    check_json({"a": nested(MAX_JSON_DEPTH - 1)})            # the body object is level 1
    for depth in (MAX_JSON_DEPTH, 100_000):                 # 100k: a recursive walk would overflow
        with pytest.raises(APIError) as e:
            check_json({"messages": [{"content": nested(depth)}]})
        assert (e.value.status, e.value.code, e.value.param) == (400, "json_too_deep", "messages")


def test_check_json_names_the_path_of_a_lone_surrogate():
    check_json(json.loads('{"a": "\\ud83d\\ude00", "\\u00e9": ["ok"]}'))    # a pair is one character
    for body, path in [('{"model": "\\ud800"}', "model"),
                       ('{"messages": [{"role": "user", "content": "hi\\udfff"}]}', "messages[0].content"),
                       ('{"stop": ["a", "b\\ud800c"]}', "stop[1]"),
                       ('{"logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800")]:
        with pytest.raises(APIError) as e:
            check_json(json.loads(body))
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_unicode", path), body
        e.value.response()                                  # the error itself encodes as JSON


def test_error_messages_show_no_absolute_paths():
    cases = {
        "restore failed: [Errno 2] No such file or directory: '/srv/my slots/a.bin'":
            "restore failed: [Errno 2] No such file or directory: 'a.bin'",
        "/home/u/.cache/slots/a.bin: not a ggmlx state": "a.bin: not a ggmlx state",
        "saved by another model (fingerprint differs from /models/x/smol.gguf)":
            "saved by another model (fingerprint differs from smol.gguf)",
        "n_ctx / 4, save/restore, ./rel/x, http://host/a/b": "n_ctx / 4, save/restore, ./rel/x, http://host/a/b",
    }
    for message, scrubbed in cases.items():
        assert scrub_paths(message) == scrubbed
    assert APIError(400, "cannot read /var/lib/slots/x.bin").message == "cannot read x.bin"


def test_schema_depth_is_bounded():
    structured.spec_json_schema(deep_schema(20))
    for schema in (deep_schema(40), deep_schema(3000), '{"a": ' * 3000 + "1" + "}" * 3000):
        with pytest.raises(GrammarError, match=f"nested more than {structured.MAX_SCHEMA_DEPTH} levels"):
            structured.spec_json_schema(schema)
    assert structured.schema_depth(deep_schema(3)) == 7


def test_the_byte_bound_is_a_lower_bound_on_tokens(served):
    vocab = served[0].vocab
    most = max_token_bytes(vocab)
    assert most is not None and most == max(map(len, vocab.texts))
    texts = ["", "a", " " * 1000, "hello world " * 50, "日本語のテキスト" * 30, "\n\t " * 100, "<s></s>" * 40,
             "".join(vocab.texts[t].decode("utf-8", "replace") for t in range(0, vocab.n_tokens, 7))]
    for text in texts:
        assert len(vocab.tokenize(text, False, True)) >= min_tokens(text, vocab), text[:40]


def test_slot_names_are_bounded_and_links_refused(tmp_path):
    longest = "s" * state.MAX_SLOT_FILENAME_BYTES
    assert state.MAX_SLOT_FILENAME_BYTES == 255 - len(".12345678.tmp")
    state.write_atomic(state.slot_path(tmp_path, longest), b"data")      # its temporary name fits NAME_MAX
    assert (tmp_path / longest).read_bytes() == b"data" and os.listdir(tmp_path) == [longest]
    for name in (longest + "s", "é" * 122):                               # 243 and 244 bytes
        with pytest.raises(StateError, match=f"too long.*at most {state.MAX_SLOT_FILENAME_BYTES} bytes"):
            state.slot_path(tmp_path, name)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOPSECRET")
    (tmp_path / "link.bin").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo.bin")
    for name, what in (("link.bin", "symbolic link"), ("fifo.bin", "not a regular file")):
        with pytest.raises(StateError, match=what):
            state.slot_path(tmp_path, name)
    with pytest.raises(StateError, match="symbolic link"):
        state.read_file(tmp_path / "link.bin", 100)                     # O_NOFOLLOW: a link swapped in later
    with pytest.raises(StateError, match="not a regular file"):
        state.read_file(tmp_path / "fifo.bin", 100)                     # O_NONBLOCK: no writer, no hang
    assert state.read_file(secret, 100) == b"TOPSECRET"


# -- over real HTTP ----------------------------------------------------------------------------

@pytest.mark.slow
def test_deep_json_is_a_400(http):
    api_error(http.post("/v1/completions", b"[" * 100_000), 400, None, "json_too_deep")
    api_error(http.post("/v1/completions", {"prompt": nested(200)}), 400, "prompt", "json_too_deep")
    api_error(http.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "x", "schema": deep_schema(40)}}}),
              400, "response_format", "json_too_deep")
    assert_healthy(http)


@pytest.mark.slow
def test_lone_surrogates_are_a_400(http):
    api_error(http.post("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'), 400, "model", "invalid_unicode")
    api_error(http.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}'),
              400, "messages[0].content", "invalid_unicode")
    api_error(http.post("/slots/0?action=save", b'{"filename": "x\\ud800.bin"}'), 400, "filename", "invalid_unicode")
    assert_healthy(http)


@pytest.mark.slow
def test_a_schema_too_deep_to_convert_is_a_400(http):
    """3,000 levels as JSON text in the schema field (read_json's depth bound cannot see into a
    string) gave a 500 RecursionError."""
    deep_text = '{"type": "object", "properties": {"a": ' * 3000 + '{"type": "string"}' + "}}" * 3000
    for rf in ({"type": "json_schema", "json_schema": {"name": "x", "schema": deep_text}},
               {"type": "json_object", "schema": deep_text}, CYCLE):
        message = api_error(http.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "response_format": rf}),
                            400, "response_format")
        assert "nested more than" in message or rf is CYCLE, message
    assert_healthy(http)


@pytest.mark.slow
def test_a_huge_prompt_is_refused_before_it_is_tokenized(http):
    """7.5 MB of text (SmolLM2 took 9.5 s to tokenize it) is refused from its byte length alone:
    the message says so."""
    text = "lorem ipsum dolor sit amet " * 280_000
    for path, body, param in [
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/completions", {"prompt": ["short", [1, 2], text]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": text}]}, "messages")]:
        message = api_error(http.post(path, body), 400, param, "context_length_exceeded")
        assert "from its length in bytes" in message, message
    message = api_error(http.post("/v1/embeddings", {"input": ["hi", text[:50_000]]}), 400, "input")
    assert "item 1 has at least" in message, message
    message = api_error(http.post("/v1/embeddings", {"input": ["word " * 800] * 2000}), 400, "input")
    assert "more than 300000 tokens" in message, message
    fits = http.post("/v1/completions", {"prompt": "hello " * 20, "max_tokens": 2, "temperature": 0.0})
    assert fits.status_code == 200, fits.text
    assert_healthy(http)


def _wait_closed(sock: socket.socket, t0: float) -> float:
    """Seconds from `t0` until the server closes `sock` (reading what it sends meanwhile)."""
    sock.settimeout(TIMEOUT_S + 5)
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def _trickle_until_closed(sock: socket.socket, t0: float) -> float:
    """Send a byte every 0.2 s until the server closes `sock`; seconds from `t0`."""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < TIMEOUT_S + 5:
        try:
            sock.sendall(b"x")
            if sock.recv(4096) == b"":
                break
        except TimeoutError:
            continue
        except OSError:         # reset by the server
            break
    return time.monotonic() - t0


@pytest.mark.slow
def test_slow_request_heads_are_closed(http):
    """slow-loris: a connection that sends nothing, or half a request head, is closed after the
    header timeout; so is a keep-alive connection whose next head stalls (before uvicorn's 5 s
    keep-alive timeout, which a byte of data cancels)."""
    t0 = time.monotonic()
    idle, partial = http.connect(), http.connect()
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    for sock in (idle, partial):
        with sock:
            assert TIMEOUT_S * 0.9 < _wait_closed(sock, t0) < TIMEOUT_S + 3
    with http.connect() as kept:
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(10)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        kept.sendall(b"GET /health HTTP/1.1\r\nHost")
        assert TIMEOUT_S * 0.9 < _wait_closed(kept, t0) < TIMEOUT_S + 3
    with http.connect() as sock:        # answered before its body is read (413), then the body trickles
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
        assert _trickle_until_closed(sock, time.monotonic()) < TIMEOUT_S + 3
    assert_healthy(http)


@pytest.mark.slow
def test_a_stalled_body_is_a_408_and_a_slow_one_is_served(http):
    with http.connect() as sock:
        sock.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"tokens\": [")
        sock.settimeout(TIMEOUT_S + 5)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    body = b'{"tokens": [1, 2, 3]}'
    with http.connect() as sock:           # each part arrives within the timeout: served
        sock.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for part in (body[:5], body[5:12], body[12:]):
            time.sleep(TIMEOUT_S * 0.6)
            sock.sendall(part)
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert_healthy(http)


@pytest.mark.slow
def test_slot_files_over_http(http):
    """Error bodies name no server directory; a link planted in the slot directory is refused
    without showing its target's bytes; a non-state file's bytes are not echoed; a name too long
    for the temporary file is a 400, the longest one that fits is saved and restored."""
    slots = http.slots_dir
    message = api_error(http.post("/slots/0?action=restore", {"filename": "missing.bin"}), 400, "filename")
    assert "missing.bin" in message and str(slots) not in message and "/" not in message, message
    secret = slots.parent / "secret.txt"
    secret.write_bytes(b"TOPSECRET and more")
    (slots / "planted.bin").symlink_to(secret)
    (slots / "notastate.bin").write_bytes(b"TOPSECRET and more, long enough to be read as a header")
    for name in ("planted.bin", "notastate.bin"):
        message = api_error(http.post("/slots/0?action=restore", {"filename": name}), 400, "filename")
        assert "TOPSECRET" not in message and "TOPS" not in message and str(slots) not in message, message
    message = api_error(http.post("/slots/0?action=save", {"filename": "n" * 255}), 400, "filename")
    assert "too long" in message
    longest = "n" * state.MAX_SLOT_FILENAME_BYTES
    for action in ("save", "restore"):
        r = http.post(f"/slots/0?action={action}", {"filename": longest})
        assert r.status_code == 200, r.text
    assert (slots / "planted.bin").is_symlink() and secret.read_bytes() == b"TOPSECRET and more"
    assert_healthy(http)
