"""The server's routes in-process on a tiny generated model (Starlette's TestClient, the real
app and Engine thread): response_format constrains the output, slots are saved and restored
through files, /v1/embeddings answers in OpenAI's format, and bad input gets 400/404/409."""
from __future__ import annotations

import base64
import json

import jsonschema
import numpy as np
import pytest
from starlette.testclient import TestClient
from tiny_model import TinySpec, write_model

import llm
from llm.serving import Engine
from llm.serving.app import create_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llm.LLM(write_model(tmp_path_factory.mktemp("s") / "tiny.gguf", TinySpec(seed=5)), n_ctx=1024,
                   n_seq_max=2)


@pytest.fixture(scope="module")
def app(tiny, tmp_path_factory):
    engine = Engine(tiny.ctx, tiny.vocab, n_slots=2).start()
    slots = tmp_path_factory.mktemp("slots")
    with TestClient(create_app(tiny, engine, model_name="tiny", slot_save_path=slots)) as c:
        c.slots_dir = slots
        yield c
    engine.stop()


def error(r, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param, e
    return e["message"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.slow
def test_response_format_json_schema(app, seed):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                                               "temperature": 1.0, "seed": seed, "response_format": rf})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.slow
def test_response_format_json_object_on_completions(app):
    r = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "temperature": 1.0, "seed": 3,
                                          "n": 2, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["text"]), dict)


@pytest.mark.slow
def test_response_format_text_is_unconstrained(app):
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0.0}
    plain = app.post("/v1/completions", json=body).json()["choices"][0]["text"]
    text = app.post("/v1/completions", json={**body, "response_format": {"type": "text"}}).json()
    assert text["choices"][0]["text"] == plain


@pytest.mark.parametrize("rf", [
    "json", {"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}},
])
def test_bad_response_format_is_400(app, rf):
    r = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                               "response_format": rf})
    assert "response_format" in error(r, 400, "response_format")


@pytest.mark.slow
def test_slot_save_and_restore(app, tiny):
    prompt = "the quick brown fox jumps over the lazy dog"
    r = app.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                          "cache_prompt": True})
    assert r.status_code == 200, r.text
    n_prompt = r.json()["usage"]["prompt_tokens"]
    slot = min(s["id"] for s in app.get("/slots").json())   # the one job took the lowest free slot
    r = app.post(f"/slots/{slot}?action=save", json={"filename": "fox.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == slot and saved["filename"] == "fox.bin"
    assert saved["n_saved"] == n_prompt + 3        # the prompt and the generated tokens decoded
    assert (app.slots_dir / "fox.bin").stat().st_size > 0
    other = 1 - slot
    r = app.post(f"/slots/{other}?action=restore", json={"filename": "fox.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == saved["n_saved"] and "restore_ms" in r.json()["timings"]
    mem = tiny.ctx.memory
    assert mem.seq_pos_max(other) == saved["n_saved"] - 1


def test_slot_errors(app):
    assert "does not exist" in error(app.post("/slots/7?action=save", json={"filename": "a"}), 404, "id_slot")
    assert "does not exist" in error(app.post("/slots/x?action=save", json={"filename": "a"}), 404, "id_slot")
    error(app.post("/slots/0?action=erase", json={"filename": "a"}), 400, "action")
    for bad in ("../a", "", "a/b", None):
        error(app.post("/slots/0?action=save", json={"filename": bad}), 400, "filename")
    error(app.post("/slots/0?action=restore", json={"filename": "missing.bin"}), 400, "filename")
    (app.slots_dir / "junk.bin").write_bytes(b"not a state file")
    assert "restore failed" in error(app.post("/slots/0?action=restore", json={"filename": "junk.bin"}),
                                     400, "filename")


@pytest.mark.slow
def test_embeddings(app, tiny):
    texts = ["hello world", "a b c"]
    r = app.post("/v1/embeddings", json={"input": texts, "model": "tiny"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "tiny"
    ref = tiny.embed(texts, normalize=True)
    assert [d["index"] for d in out["data"]] == [0, 1] and all(d["object"] == "embedding" for d in out["data"])
    np.testing.assert_allclose(np.array([d["embedding"] for d in out["data"]]), ref, rtol=1e-6, atol=1e-6)
    n_tok = sum(len(tiny.tokenize(t)) for t in texts)
    assert out["usage"] == {"prompt_tokens": n_tok, "total_tokens": n_tok}
    one = app.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, ref[0], rtol=1e-6, atol=1e-6)
    toks = app.post("/v1/embeddings", json={"input": [tiny.tokenize(texts[1])]}).json()
    np.testing.assert_allclose(toks["data"][0]["embedding"], ref[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [1.5]}, "input"), ({"input": [[10 ** 9]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "model": "gpt-4"}, "model"),
])
def test_bad_embeddings_are_400(app, body, param):
    error(app.post("/v1/embeddings", json=body), 400, param)
