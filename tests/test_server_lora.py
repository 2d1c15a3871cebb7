"""LoRA adapters in the server (issue 31), over real HTTP with the official openai client:
`serve --lora-scaled`, GET / POST /lora-adapters and a request's own `"lora"` as llama-server
has them, and two concurrent requests with different adapters each getting what they get alone
(they decode in one batch, per-sequence scales)."""
from __future__ import annotations

import threading

import httpx
import pytest
from test_lora import random_pairs
from test_server import Server
from tiny_model import TinySpec, write_model

import llm
from llm.adapter import write_lora

pytestmark = pytest.mark.slow
PROMPT = "the river ran past old mills and"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv-lora")
    base = write_model(d / "base.gguf", TinySpec(n_layer=2, seed=5))
    adapter = d / "one.gguf"
    write_lora(adapter, "llama", random_pairs(1), alpha=8.0)
    return base, adapter


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    base, adapter = files
    s = Server(base, tmp_path_factory.mktemp("srv-lora-log") / "server.log", "-np", "2", "-c", "256",
               "--no-warmup", "--lora-scaled", str(adapter), "0.8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(files):
    """Greedy texts of the adapter at 0.8, at 0.3 and of the bare model, from the Python API."""
    base, adapter = files
    m = llm.LLM(base, lora=[(adapter, 0.8)], n_ctx=256, n_seq_max=2)
    return {s: m.generate(PROMPT, 12, temperature=0.0, lora=[s]).text for s in (0.8, 0.3, 0.0)}


def complete(server, **extra) -> str:
    r = server.client().completions.create(model="base", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                           extra_body=extra or None)
    return r.choices[0].text


def test_the_adapter_applies_to_every_request(server, expected):
    assert httpx.get(server.url + "/lora-adapters").json() == [{"id": 0, "path": "one.gguf", "scale": 0.8}]
    assert complete(server) == expected[0.8]
    assert expected[0.8] != expected[0.0]


def test_a_request_carries_its_own_scales(server, expected):
    assert complete(server, lora=[{"id": 0, "scale": 0.3}]) == expected[0.3]
    assert complete(server, lora=[]) == expected[0.0]          # not listed: scale 0, as llama-server


def test_concurrent_requests_with_different_adapters(server, expected):
    got: dict = {}

    def run(scale):
        got[scale] = complete(server, lora=[{"id": 0, "scale": scale}])

    threads = [threading.Thread(target=run, args=(s,)) for s in (0.8, 0.0, 0.3, 0.8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {s: expected[s] for s in (0.8, 0.0, 0.3)}


def test_post_lora_adapters_sets_the_default_scales(server, expected):
    r = httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": 0.3}])
    assert r.status_code == 200 and r.json() == {"success": True}
    try:
        assert httpx.get(server.url + "/lora-adapters").json()[0]["scale"] == 0.3
        assert complete(server) == expected[0.3]
    finally:
        httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": 0.8}])


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "lora": [{"id": 3, "scale": 1}]}, "lora[0].id"),
    ("/v1/completions", {"prompt": "x", "lora": {"id": 0}}, "lora"),
    ("/v1/completions", {"prompt": "x", "lora": [{"id": 0, "scale": "big"}]}, "lora[0].scale"),
    ("/lora-adapters", {"id": 0, "scale": 1}, None),
    ("/lora-adapters", [{"id": 1, "scale": 1}], "body[0].id"),
])
def test_bad_adapter_fields_are_a_400(server, route, body, param):
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
