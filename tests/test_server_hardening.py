"""Issue 35 (server hardening, round two), first part: a request that passes the field checks but
cannot run (a sampler value llama.cpp's samplers refuse, a JSON schema llguidance cannot run) is
refused at admission with a 4xx on its own, and the server goes on; `grammar` (GBNF) is taken in
request bodies as llama-server takes it."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from tiny_model import TinySpec, write_model

import llm
from llm.serving import Engine
from llm.serving.app import create_app

CYCLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/a",
                                                                        "$defs": {"a": {"$ref": "#/$defs/a"}}}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    m = llm.LLM(write_model(tmp_path_factory.mktemp("h") / "tiny.gguf", TinySpec(seed=5)), n_ctx=512, n_seq_max=2)
    engine = Engine(m.ctx, m.vocab, n_slots=2).start()
    with TestClient(create_app(m, engine, model_name="tiny")) as c:
        yield c
    engine.stop()


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
