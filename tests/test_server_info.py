"""GET /metrics, GET /props and the chat page's files on the real app and Engine (a tiny generated
model, Starlette's TestClient): the counters grow by exactly the tokens of each request, the
metric names, types and help texts are llama-server's, /metrics is llama-server's 501 without
--metrics, / is a 404 without the page, and the page's files are package data."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from tiny_model import TinySpec, write_model

import llm
from llm.params import ServerEndpoints
from llm.serving import Engine
from llm.serving.app import create_app
from llm.serving.webui import STATIC

ROOT = Path(__file__).resolve().parents[1]
# llama-server's names and types (tools/server/server-context.cpp; kv_cache_* from its older versions)
TYPES = {"prompt_tokens_total": "counter", "prompt_seconds_total": "counter", "tokens_predicted_total": "counter",
         "tokens_predicted_seconds_total": "counter", "n_decode_total": "counter", "n_tokens_max": "counter",
         "n_busy_slots_per_decode": "counter", "prompt_tokens_seconds": "gauge", "predicted_tokens_seconds": "gauge",
         "kv_cache_usage_ratio": "gauge", "kv_cache_tokens": "gauge", "requests_processing": "gauge",
         "requests_deferred": "gauge"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llm.LLM(write_model(tmp_path_factory.mktemp("s") / "tiny.gguf", TinySpec(seed=5)), n_ctx=512,
                   n_seq_max=2)


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny.ctx, tiny.vocab, n_slots=2).start()
    yield e
    e.stop()


def client(tiny, engine, **kw) -> TestClient:
    return TestClient(create_app(tiny, engine, model_name="tiny", **kw))


@pytest.fixture(scope="module")
def app(tiny, engine):
    with client(tiny, engine, endpoints=ServerEndpoints(metrics=True)) as c:
        yield c


def scrape(app) -> dict[str, float]:
    r = app.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for line in r.text.splitlines():
        if not line.startswith("#"):
            name, value = line.split(" ")
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


def complete(app, **kw) -> dict:
    body = {"prompt": "one two three four five", "max_tokens": 6, "temperature": 0, "cache_prompt": False, **kw}
    r = app.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def grew(before: dict, after: dict, name: str) -> float:
    return after[name] - before[name]


def test_metrics_names_types_and_help_are_llama_servers(app):
    text = app.get("/metrics").text
    lines = text.splitlines()
    for name, kind in TYPES.items():
        assert f"# TYPE llamacpp:{name} {kind}" in lines, name
    assert "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed." in lines
    assert "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed." in lines
    assert "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage." in lines
    assert len([x for x in lines if not x.startswith("#")]) == len(TYPES)


@pytest.mark.slow
def test_counters_grow_by_exactly_the_tokens_of_each_request(app):
    before = scrape(app)
    usage = complete(app)
    after = scrape(app)
    assert usage["completion_tokens"] > 0
    assert grew(before, after, "tokens_predicted_total") == usage["completion_tokens"]
    assert grew(before, after, "prompt_tokens_total") == usage["prompt_tokens"]
    assert grew(before, after, "n_decode_total") >= 1
    assert grew(before, after, "prompt_seconds_total") > 0 and grew(before, after, "tokens_predicted_seconds_total") > 0
    assert after["n_tokens_max"] >= usage["total_tokens"]
    # two samples at once: both slots busy in every step, both samples' tokens counted
    usage = complete(app, n=2, temperature=1.0, seed=3)
    again = scrape(app)
    assert grew(after, again, "tokens_predicted_total") == usage["completion_tokens"]
    assert again["n_busy_slots_per_decode"] > after["n_busy_slots_per_decode"]


def test_a_cached_prefix_is_not_counted_as_prompt_tokens(app):
    complete(app, cache_prompt=True)
    before = scrape(app)
    usage = complete(app, cache_prompt=True)
    after = scrape(app)
    assert 1 <= grew(before, after, "prompt_tokens_total") < usage["prompt_tokens"]
    assert grew(before, after, "tokens_predicted_total") == usage["completion_tokens"]
    assert after["kv_cache_tokens"] > 0          # the slot keeps its cells
    assert after["kv_cache_usage_ratio"] == after["kv_cache_tokens"] / 512


def test_throughput_gauges_cover_the_time_since_the_previous_scrape(app):
    complete(app)
    first = scrape(app)
    assert first["predicted_tokens_seconds"] > 0 and first["prompt_tokens_seconds"] > 0
    second = scrape(app)
    assert second["predicted_tokens_seconds"] == 0 and second["prompt_tokens_seconds"] == 0
    assert second["requests_processing"] == 0 and second["requests_deferred"] == 0


def test_metrics_without_the_flag_is_llama_servers_501(tiny, engine):
    with client(tiny, engine) as c:
        r = c.get("/metrics")
    assert r.status_code == 501
    e = r.json()["error"]
    assert e["type"] == "not_supported_error"
    assert e["message"] == "This server does not support metrics endpoint. Start it with `--metrics`"


def test_props(app, engine):
    p = app.get("/props").json()
    assert p["total_slots"] == 2
    assert p["default_generation_settings"]["n_ctx"] == engine.batcher.n_ctx_slot == 256
    assert p["default_generation_settings"]["params"]["temperature"] == 0.8
    assert p["default_generation_settings"]["params"]["n_predict"] == -1
    assert p["model_path"] == "tiny.gguf"          # the file's name, not the server's directories
    assert p["model_alias"] == "tiny"
    assert p["endpoint_metrics"] is True and p["webui"] is True
    assert isinstance(p["chat_template"], str) and p["chat_template"]
    assert isinstance(p["build_info"], str) and p["build_info"].startswith("ggmlx")


def test_page_files_with_a_content_security_policy(app):
    r = app.get("/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert "<textarea" in r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "'unsafe-inline'" not in r.headers["content-security-policy"]
    assert app.get("/app.js").headers["content-type"] == "text/javascript; charset=utf-8"
    assert app.get("/style.css").headers["content-type"] == "text/css; charset=utf-8"


def test_no_webui_makes_the_page_a_404_in_the_api_error_shape(tiny, engine):
    with client(tiny, engine, endpoints=ServerEndpoints(webui=False)) as c:
        r = c.get("/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert c.get("/app.js").status_code == 404
        assert c.get("/props").json()["webui"] is False


def test_the_page_is_public_with_an_api_key_and_the_api_is_not(tiny, engine):
    with client(tiny, engine, api_key="sekrit") as c:
        assert c.get("/").status_code == 200 and c.get("/app.js").status_code == 200
        assert c.get("/props").status_code == 401
        assert c.get("/props", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    with client(tiny, engine, api_key="sekrit", endpoints=ServerEndpoints(webui=False)) as c:
        assert c.get("/").status_code == 401


def test_the_page_files_are_package_data():
    """`pip install .` ships every file of the page: pyproject's globs cover them all."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llm.serving"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.iterdir()]
    assert {"static/index.html", "static/app.js", "static/style.css"} <= set(files)
    for f in files:
        assert any(fnmatch.fnmatch(f, g) for g in globs), f
