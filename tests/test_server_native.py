"""llama-server's /infill and /rerank (llm.serving.native), over real HTTP (`python -m llm serve`
in a subprocess, tests/test_server.py's Server) with plain httpx, and in-process for the prompt
they build and their 4xx answers.

- /infill on a tiny model whose GGUF names FIM tokens (tokenizer.ggml.fim_*_token_id): the prompt
  is llama-server's repo-level FIM layout, plain and streamed replies agree, a model without FIM
  tokens is a 400.
- /rerank (and its aliases) on the BERT fixture with its classifier head: the scores are the
  head's first output for [CLS] query [SEP] document, results best first and cut to top_n,
  Jina's and TEI's shapes; a model without rank pooling (or without a head) is a 400, and so is a
  request without documents.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient
from test_server import Server
from tiny_model import TinySpec, model_kv, model_tensors, write_gguf

import llm
from llm.params import ServerEndpoints
from llm.serving import Engine
from llm.serving.app import create_app
from llm.serving.native import infill_prompt, rerank_tokens

FIXTURES = Path(__file__).parent / "data" / "fixtures"
BERT = FIXTURES / "bert-F32.gguf"
# FIM token ids of the tiny model: byte tokens of the 512-token vocabulary stand in
FIM = {"pre": 3, "suf": 4, "mid": 5, "rep": 6, "sep": 7}
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "x = 1\n"}, {"text": "y = 2\n"}]


def fim_gguf(path: Path, fim: dict[str, int] = FIM) -> Path:
    spec = TinySpec(seed=3)
    kv = {**model_kv(spec), **{f"tokenizer.ggml.fim_{k}_token_id": v for k, v in fim.items()}}
    return write_gguf(path, kv, model_tensors(spec))


@pytest.fixture(scope="module")
def fim_llm(tmp_path_factory):
    return llm.LLM(fim_gguf(tmp_path_factory.mktemp("fim") / "fim.gguf"), n_ctx=1024, n_seq_max=1)


@pytest.fixture(scope="module")
def fim_app(fim_llm):
    engine = Engine(fim_llm.ctx, fim_llm.vocab, n_slots=1).start()
    with TestClient(create_app(fim_llm, engine, model_name="fim")) as c:
        yield c
    engine.stop()


def test_infill_prompt_is_llama_servers_layout(fim_llm):
    v = fim_llm.vocab

    def tok(s: str) -> list[int]:
        return v.tokenize(s, False, False)

    got = infill_prompt(v, PREFIX, SUFFIX, EXTRA, tok("a"), n_batch=512, n_ctx=1024)
    want = [FIM["rep"], *tok("myproject\n"),
            FIM["sep"], *tok("util.py\n"), *tok("x = 1\n"), FIM["sep"], *tok("tmp\n"), *tok("y = 2\n"),
            FIM["sep"], *tok("filename\n"),
            v.bos, FIM["pre"], *tok(PREFIX), *tok("a"), FIM["suf"], *tok(SUFFIX), FIM["mid"]]
    assert got == want
    # spm order: the suffix first; a small batch keeps the prefix's last 3/4 and the suffix's head
    spm = infill_prompt(v, PREFIX, SUFFIX, [], [], n_batch=512, n_ctx=1024, spm_infill=True)
    assert spm[-len(tok(PREFIX)) - 2:] == [FIM["pre"], *tok(PREFIX), FIM["mid"]]
    assert spm[:4] == [FIM["rep"], *tok("myproject\n")][:4]
    small = infill_prompt(v, PREFIX * 20, SUFFIX * 20, [], [], n_batch=64, n_ctx=1024)
    i_pre, i_suf = small.index(FIM["pre"]), small.index(FIM["suf"])
    assert small[i_pre + 1:i_suf] == tok(PREFIX * 20)[-48:]
    assert small[i_suf + 1:-1] == tok(SUFFIX * 20)[:16 - 2]
    # the extra context gets what a slot has beyond a batch and twice n_predict (-1: 2 tokens here)
    tight = infill_prompt(v, PREFIX, SUFFIX, EXTRA, [], n_batch=512, n_ctx=512)
    assert tight[:3] == [*want[v.bos and want.index(v.bos) - 2:want.index(v.bos)], v.bos]


def test_infill_in_process(fim_app, fim_llm):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "a", "n_predict": 6,
            "temperature": 0}
    r = fim_app.post("/infill", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    v = fim_llm.vocab
    n_prompt = len(infill_prompt(v, PREFIX, SUFFIX, EXTRA, v.tokenize("a", False, True), n_batch=fim_llm.ctx.n_batch,
                                 n_ctx=1024))
    assert out["stop"] is True and out["stop_type"] == "limit" and out["tokens_predicted"] == 6
    assert out["tokens_evaluated"] == n_prompt and len(out["tokens"]) == 6
    assert out["content"] == b"".join(v.token_to_piece(t) for t in out["tokens"]).decode("utf-8", "replace")
    with fim_app.stream("POST", "/infill", json={**body, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines]
    assert all(ln.startswith("data: ") for ln in lines) and "[DONE]" not in lines[-1]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == out["content"]
    assert events[-1]["tokens_predicted"] == 6
    stopped = fim_app.post("/infill", json={**body, "stop": [out["content"][2:4]]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == out["content"][2:4]


@pytest.mark.parametrize("body,field", [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": ""}, "input_suffix"),
    ({"input_prefix": 3, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "prompt": ["x"]}, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "input_extra[0].text"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 1}]},
     "input_extra[0].filename"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": 0}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "temperature": "x"}, "temperature"),
    ({"input_prefix": [99999], "input_suffix": ""}, "input_prefix"),
])
def test_infill_bad_input_is_400_naming_the_field(fim_app, body, field):
    r = fim_app.post("/infill", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_infill_without_fim_tokens_is_400(tmp_path):
    plain = llm.LLM(write_gguf(tmp_path / "plain.gguf", model_kv(TinySpec()), model_tensors(TinySpec())),
                    n_ctx=256, n_seq_max=1)
    engine = Engine(plain.ctx, plain.vocab, n_slots=1)
    with TestClient(create_app(plain, engine, model_name="plain")) as c:
        r = c.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_supported", r.text
        assert "FIM prefix, suffix, middle" in r.json()["error"]["message"]
        r = c.post("/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 400 and "classifier head" in r.json()["error"]["message"], r.text


# ---- /rerank -----------------------------------------------------------------------------------------

QUERY = "the quick brown fox"
DOCS = ["a lazy dog sleeps", "the quick brown fox jumps", "over the fence", "brown fox"]


@pytest.fixture(scope="module")
def bert():
    return llm.LLM(BERT, n_ctx=128, n_seq_max=1)


@pytest.fixture(scope="module")
def rerank_app(bert):
    engine = Engine(bert.ctx, bert.vocab, n_slots=1)
    with TestClient(create_app(bert, engine, model_name="bert", endpoints=ServerEndpoints(reranking=True))) as c:
        yield c


def test_rerank_scores_are_the_classifier_heads_first_output(rerank_app, bert):
    v = bert.vocab
    pair = rerank_tokens(v, None, QUERY, DOCS[0])
    assert pair == [v.bos, *v.tokenize(QUERY, False, False), v.sep, *v.tokenize(DOCS[0], False, False)]
    want = bert.embed([rerank_tokens(v, None, QUERY, d) for d in DOCS], normalize=False, pooling_type="rank")[:, 0]
    r = rerank_app.post("/v1/rerank", json={"model": "bert", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "bert"
    assert [x["index"] for x in out["results"]] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([x["relevance_score"] for x in out["results"]], np.sort(want)[::-1], rtol=1e-5)
    n_tok = sum(len(rerank_tokens(v, None, QUERY, d)) for d in DOCS)
    assert out["usage"] == {"prompt_tokens": n_tok, "total_tokens": n_tok}
    for path in ("/rerank", "/reranking", "/v1/reranking"):
        again = rerank_app.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True})
        res = again.json()["results"]
        assert [x["index"] for x in res] == [x["index"] for x in out["results"][:2]]
        assert all(x["document"] == {"text": DOCS[x["index"]]} for x in res)
    tei = rerank_app.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert isinstance(tei, list) and [x["index"] for x in tei] == [x["index"] for x in out["results"]]
    assert all(set(x) == {"index", "score", "text"} and x["text"] == DOCS[x["index"]] for x in tei)


@pytest.mark.parametrize("body,field", [
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "texts": []}, "texts"),
    ({"documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ({"query": QUERY, "documents": ["word " * 200]}, "documents"),
])
def test_rerank_bad_input_is_400_naming_the_field(rerank_app, body, field):
    r = rerank_app.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_rerank_needs_rank_pooling(bert):
    """The fixture's GGUF pooling is mean: without --reranking the server refuses to rerank."""
    engine = Engine(bert.ctx, bert.vocab, n_slots=1)
    with TestClient(create_app(bert, engine, model_name="bert")) as c:
        r = c.post("/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_supported", r.text
    assert "'mean', not 'rank'" in r.json()["error"]["message"]


def llamacpp_rerank(path: Path, query: str, docs: list[str]) -> tuple[list[list[int]], np.ndarray]:
    """llama.cpp's tokens and scores of each (query, document) pair, as llama-server makes them
    (format_prompt_rerank without a rerank template; one decode per pair, rank pooling, the
    first classifier output), through llama-cpp-python's C API."""
    import ctypes

    import llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)

    def tok(text: str) -> list[int]:
        buf = (L.llama_token * 512)()
        n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 512, False, False)
        return list(buf[:n])

    eos = L.llama_vocab_eos(vocab) if L.llama_vocab_eos(vocab) != -1 else L.llama_vocab_sep(vocab)
    pairs = []
    for d in docs:
        t = [L.llama_vocab_bos(vocab)] if L.llama_vocab_get_add_bos(vocab) else []
        t += tok(query) + ([eos] if L.llama_vocab_get_add_eos(vocab) else [])
        t += ([L.llama_vocab_sep(vocab)] if L.llama_vocab_get_add_sep(vocab) else []) + tok(d)
        pairs.append(t + ([eos] if L.llama_vocab_get_add_eos(vocab) else []))
    scores = []
    for t in pairs:
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 128
        cp.n_threads = cp.n_threads_batch = 2
        cp.embeddings, cp.pooling_type = True, 4      # LLAMA_POOLING_TYPE_RANK
        ctx = L.llama_init_from_model(model, cp)
        ids = (L.llama_token * len(t))(*t)      # kept alive while the batch points at it
        batch = L.llama_batch_get_one(ids, len(t))
        assert L.llama_decode(ctx, batch) == 0
        scores.append(ctypes.cast(L.llama_get_embeddings_seq(ctx, 0), ctypes.POINTER(ctypes.c_float))[0])
        L.llama_free(ctx)
    L.llama_model_free(model)
    return pairs, np.array(scores)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_rerank_matches_llama_cpp(rerank_app, bert):
    """The same pairs' tokens as llama.cpp, and its scores (within the fixture's rank-pooling
    parity: ggml's GELU table and float sums differ by a few 1e-4)."""
    pairs, want = llamacpp_rerank(BERT, QUERY, DOCS)
    assert pairs == [rerank_tokens(bert.vocab, None, QUERY, d) for d in DOCS]
    res = rerank_app.post("/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    got = np.array([next(r["relevance_score"] for r in res if r["index"] == i) for i in range(len(DOCS))])
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert [r["index"] for r in res] == list(np.argsort(-want, kind="stable"))


# ---- over real HTTP ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_infill_and_rerank_over_http(tmp_path):
    fim = Server(fim_gguf(tmp_path / "fim.gguf"), tmp_path / "fim.log", "-np", "1", "-c", "512", "--no-warmup")
    try:
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0}
        r = httpx.post(fim.url + "/infill", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
        with httpx.stream("POST", fim.url + "/infill", json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(ln.removeprefix("data: ")) for ln in s.iter_lines() if ln]
        assert "".join(e["content"] for e in events) == r.json()["content"] and events[-1]["stop"]
    finally:
        fim.stop()
    rr = Server(BERT, tmp_path / "bert.log", "-np", "1", "-c", "128", "--no-warmup", "--reranking")
    try:
        r = httpx.post(rr.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=120)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert len(res) == 3 and [x["relevance_score"] for x in res] == sorted((x["relevance_score"] for x in res),
                                                                             reverse=True)
        r = httpx.post(rr.url + "/rerank", json={"query": QUERY, "documents": []}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    finally:
        rr.stop()
