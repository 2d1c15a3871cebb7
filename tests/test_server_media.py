"""Images in `python -m llm serve --mmproj`: chat image_url parts over real HTTP with the official
openai client, on the tiny seeded gemma3 pair of tests/data/mtmd (benchmarks/reference/make_mmproj.py).
One server process for the module; the library's LLM.chat in this process is the reference."""
from __future__ import annotations

import base64
import functools
import http.server
import re
import threading

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient
from test_server import ROOT, Server

import llm
from llm.errors import StateError
from llm.generation.batcher import Batcher, Job, media_prompt
from llm.generation.core import GenParams
from llm.params import MediaParams
from llm.serving.app import create_app
from llm.serving.engine import Engine

pytestmark = pytest.mark.slow
DATA = ROOT / "tests" / "data" / "mtmd"
MODEL, MMPROJ, IMAGE = DATA / "gemma3.gguf", DATA / "gemma3.mmproj.gguf", DATA / "test-image.png"
N_CTX_SLOT = 256


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def ask(*parts: dict, text: str = "What is in this picture? ") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


PNG, PNG_2 = IMAGE.read_bytes(), (DATA / "test-image-2.png").read_bytes()
QUESTION = ask(image(data_url(PNG)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(MODEL, tmp_path_factory.mktemp("srv") / "server.log", "--mmproj", str(MMPROJ), "-np", "2",
               "-c", str(2 * N_CTX_SLOT), "--no-warmup")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def vlm():
    return llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=N_CTX_SLOT)


@pytest.fixture(scope="module")
def want(vlm) -> llm.Completion:
    """The library's answer to QUESTION, computed before anything else runs on vlm."""
    return vlm.chat(QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)


def test_an_image_answer_equals_the_librarys_chat_streamed_or_not(server, client, want):
    r = client.chat.completions.create(model="gemma3", messages=QUESTION, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == want.text and want.n_completion_tokens == 8
    assert r.usage.prompt_tokens == want.n_prompt_tokens and r.usage.completion_tokens == 8
    got = [[t.logprob for t in lp.top_logprobs] for lp in r.choices[0].logprobs.content]
    assert np.allclose(got, [[v for _, v in lp.top] for lp in want.logprobs], atol=1e-4)
    other = client.chat.completions.create(model="gemma3", messages=ask(image(data_url(PNG_2))), max_tokens=1,
                                           temperature=0, logprobs=True, top_logprobs=3)
    assert not np.allclose([t.logprob for t in other.choices[0].logprobs.content[0].top_logprobs], got[0],
                           atol=1e-2)         # the answer reads the image
    chunks = list(client.chat.completions.create(model="gemma3", messages=QUESTION, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    props = httpx.get(server.url + "/props", timeout=10).json()
    assert props["modalities"]["vision"] is True


def test_two_image_requests_at_once_equal_one_at_a_time(client, want):
    """Both slots prefill an image while the other decodes (the engine loop's batches)."""
    other = ask(image(data_url(PNG)), text="Describe ")
    alone = client.chat.completions.create(model="gemma3", messages=other, max_tokens=8, temperature=0)
    done: dict = {}

    def run(key: str, messages: list[dict]) -> None:
        done[key] = client.chat.completions.create(model="gemma3", messages=messages, max_tokens=8, temperature=0)

    threads = [threading.Thread(target=run, args=a) for a in (("q", QUESTION), ("o", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert done["q"].choices[0].message.content == want.text
    assert done["o"].choices[0].message.content == alone.choices[0].message.content


def test_cache_prompt_and_n_samples_with_an_image(client, want):
    """cache_prompt keeps a slot's cells up to the first image (the BOS and the turn's opening);
    n = 2 samples share the prompt's cells, image included (seq_cp)."""
    for _ in range(2):
        r = client.chat.completions.create(model="gemma3", messages=QUESTION, max_tokens=8, temperature=0,
                                           extra_body={"cache_prompt": True})
        assert r.choices[0].message.content == want.text
    r = client.chat.completions.create(model="gemma3", messages=QUESTION, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [want.text, want.text]


def bad_request(client: openai.OpenAI, messages: list[dict]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gemma3", messages=messages, max_tokens=2)
    return e.value


@pytest.mark.parametrize("part, message", [
    (image("data:image/png;base64,%%%not base64"), "base64 is invalid"),
    (image(data_url(PNG[:40] + bytes(200))), "cannot decode the image|not an image"),
    (image(data_url(b"not an image at all")), "not an image in a known format"),
    ({"type": "image_url", "image_url": {}}, "an image_url part must be"),
    ({"type": "image_url"}, "an image_url part must be"),
    ({"type": "input_video", "input_video": {}}, "must be .*text.* or .*image_url"),
    (image("http://127.0.0.1:9/a.png"), "remote image URLs are not fetched .*--allow-remote-media"),
])
def test_bad_media_is_a_400_naming_the_part(client, part, message):
    e = bad_request(client, ask(image(data_url(PNG)), part))
    assert e.param == "messages[0].content[2]", e.body
    assert e.body["message"].startswith("messages[0].content[2]") and re.search(message, e.message)


def test_more_images_than_a_slot_holds_name_the_first_that_does_not_fit(client, vlm):
    n_pos = sum(c.n_pos for c in vlm.media_prompt(llm.mtmd.default_marker(), [IMAGE]))   # one image and its markup
    k = N_CTX_SLOT // n_pos + 1         # enough images to run past the slot
    e = bad_request(client, [{"role": "user", "content": [image(data_url(PNG))] * k}])
    assert e.code == "context_length_exceeded" and e.param.startswith("messages[0].content["), e.body
    assert 0 < int(e.param.split("[")[-1][:-1]) < k and "a slot holds 256" in e.message
    marker = bad_request(client, ask(image(data_url(PNG)), text=f"a marker in the text {llm.mtmd.default_marker()}"))
    assert marker.param == "messages" and "2 media markers" in marker.message, marker.body


def test_the_server_keeps_serving_after_bad_media(client, want, server):
    bad_request(client, ask(image("data:image/png;base64,AAAA")))
    r = client.chat.completions.create(model="gemma3", messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.text
    assert server.health()["slots_processing"] == 0


# ---- in this process: the engine's Batcher, --allow-remote-media, a server without --mmproj ----


def test_a_slot_shares_its_cells_through_an_image_only_with_the_same_image(vlm, tmp_path):
    """The Batcher as the engine runs it: a kept slot's prefix goes through an image when the
    next prompt has the same image there (no encoder run, its cells not decoded again); another
    image, or text spelling the placeholder tokens, shares only what comes before the image."""
    b = Batcher(vlm.ctx, vlm.vocab, mtmd=vlm.mtmd)
    marker = llm.mtmd.default_marker()

    def run(tokens: list[int], media: dict | None = None) -> Job:
        job = Job(tokens, GenParams(max_tokens=2), lambda ev: None, cache_prompt=True, media=media)
        b.submit(job)
        while not job.finished:
            b.step()
        assert job.state == "done"
        return job

    try:
        tokens, media = media_prompt(vlm.media_prompt(f"Look {marker} What is it?", [IMAGE]))
        start = min(media)
        end = start + media[start].n_pos
        run(tokens, media)
        n_encode = vlm.mtmd.n_encode
        again = run(*media_prompt(vlm.media_prompt(f"Look {marker} What colour?", [IMAGE])))
        assert again.n_cached > end and vlm.mtmd.n_encode == n_encode
        other = run(*media_prompt(vlm.media_prompt(f"Look {marker} What colour?", [DATA / "test-image-2.png"])))
        assert other.n_cached == start
        with pytest.raises(StateError, match="holds an image"):
            b.save_slot(0, tmp_path / "slot.bin")
        assert run(other.tokens).n_cached == start         # the placeholders as text tokens
    finally:
        vlm.reset()         # this Batcher used vlm's cells


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server (127.0.0.1) serving tests/data/mtmd; no other network is used."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(DATA))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_remote_images_are_fetched_with_allow_remote_media(vlm, want, image_host):
    engine = Engine(vlm.ctx, vlm.vocab, n_slots=1, mtmd=vlm.mtmd).start()
    try:
        app = create_app(vlm, engine, model_name="gemma3", media=MediaParams(allow_remote_media=True))
        with TestClient(app) as http_client:
            c = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http_client, max_retries=0)
            r = c.chat.completions.create(model="gemma3", messages=ask(image(f"{image_host}/test-image.png")),
                                          max_tokens=8, temperature=0)
            assert r.choices[0].message.content == want.text
            e = bad_request(c, ask(image(f"{image_host}/no-such-image.png")))
            assert e.param == "messages[0].content[1]" and "HTTP 404" in e.message
    finally:
        engine.stop()
        vlm.reset()         # the engine's batcher used vlm's cells


def test_a_server_without_mmproj_names_the_image_part():
    text_only = llm.LLM(MODEL, n_ctx=64)
    engine = Engine(text_only.ctx, text_only.vocab, n_slots=1).start()
    try:
        with TestClient(create_app(text_only, engine, model_name="gemma3")) as c:
            r = c.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages[0].content[1]", r.text
            assert "without --mmproj" in err["message"]
            assert c.get("/props").json()["modalities"]["vision"] is False
    finally:
        engine.stop()

