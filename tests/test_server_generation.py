"""`serve`'s generation flags over real HTTP with the official openai client (issue 32):
`-a/--alias` (the names the API answers to), `--context-shift` (a full slot discards half of
its tokens and goes on) and speculative decoding for every request (`--draft-model`, a context
of its own per slot; `--lookup`), on a tiny seeded model whose own copy is the draft model."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_server import Server
from tiny_model import TinySpec, write_model

import llm

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinySpec(n_layer=2, seed=7))


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    """2 slots of 64 cells, context shift, the model drafting for itself (3 tokens at most)."""
    s = Server(path, tmp_path_factory.mktemp("srv") / "server.log", "-np", "2", "-c", "128", "-b", "64", "-ub", "64",
               "--no-warmup", "-a", "tiny-a, tiny-b", "--context-shift", "--draft-model", str(path),
               "--spec-draft-n-max", "3")
    yield s
    s.stop()


def test_aliases_name_the_model(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["tiny-a"]
    r = c.completions.create(model="tiny-b", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.model == "tiny-a" and r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="this server has 'tiny-a'"):
        c.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_draft_model_output_is_the_greedy_output(server, path):
    """Speculative decoding keeps greedy output token-identical (a draft of the same model:
    every draft is kept), two requests at once each with their slot's draft context."""
    want = llm.LLM(str(path), n_ctx=64).generate(PROMPT, max_tokens=20, temperature=0.0).text
    r = server.client().completions.create(model="tiny-a", prompt=PROMPT, max_tokens=20, temperature=0)
    t = r.model_extra["timings"]        # llama-server's, with its draft counts
    assert r.choices[0].text == want and t["predicted_n"] == 20
    assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        texts = list(ex.map(lambda _: server.client().completions.create(
            model="tiny-a", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text, range(2)))
    assert texts == [want, want]


def test_context_shift_goes_past_the_slot(server):
    """A 64-cell slot and 100 tokens to generate: the slot shifts and the answer has all 100
    (without --context-shift it would end with 'length' after 64 - prompt tokens)."""
    r = server.client().completions.create(model="tiny-a", prompt=PROMPT, max_tokens=100, temperature=0)
    assert r.usage.completion_tokens == 100 and r.choices[0].finish_reason == "length"
    kept = server.client().completions.create(model="tiny-a", prompt=PROMPT, max_tokens=100, temperature=0,
                                              extra_body={"n_keep": -1})     # the whole prompt stays
    assert kept.usage.completion_tokens == 100 and kept.choices[0].text != r.choices[0].text
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "n_discard": -2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n_discard"
