"""llm.LLM misused, on a tiny model (issue 19): bad prompt and stop arguments, two live
streams, two threads, a decode failing mid-generation, compiles in the middle of a
generation, chat on a model without a chat template."""
from __future__ import annotations

import logging
import threading

import pytest
from test_context import FailingEval
from tiny_model import TinySpec, write_model

import llm
from llm.api import LLMBusyError

PROMPTS = ["Hello world", "The cat sat on", "Once upon a time", "One two three"]
GREEDY = dict(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("api") / "tiny.gguf", TinySpec(seed=5))


@pytest.fixture(scope="module")
def m(tiny_path) -> llm.LLM:
    return llm.LLM(tiny_path, n_ctx=128, kv_bucket=32)


@pytest.fixture(scope="module")
def refs(m) -> dict[str, llm.Completion]:
    return {p: m.generate(p, **GREEDY) for p in PROMPTS}


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("prompt,error,match", [
    (b"hello", TypeError, "got bytes .*prompt.decode"),
    (bytearray(b"hi"), TypeError, "got bytearray"),
    (7, TypeError, "text \\(str\\) or a list of token ids, got int"),
    ([1, "a"], TypeError, r"prompt\[1\] = 'a' is not a token id"),
    ([1, 2.0], TypeError, r"prompt\[1\] = 2.0 is not a token id"),
    ([1, 512], ValueError, r"prompt\[1\] = 512 is not a token id of this model \[0, 512\)"),
    ([-1], ValueError, r"prompt\[0\] = -1"),
    ([], ValueError, "the prompt is empty"),
])
@pytest.mark.slow
def test_bad_prompts_are_typed_errors(m, refs, prompt, error, match):
    with pytest.raises(error, match=match) as e:
        m.stream(prompt)
    _one_line(e)
    assert m.generate(PROMPTS[0], **GREEDY).text == refs[PROMPTS[0]].text


@pytest.mark.parametrize("stop,error,match", [
    ("", ValueError, r"stop\[0\] is an empty string"),
    ([""], ValueError, r"stop\[0\] is an empty string"),
    (["x", ""], ValueError, r"stop\[1\] is an empty string"),
    ([None], TypeError, r"stop\[0\] = None is not a string"),
    (["x", 3], TypeError, r"stop\[1\] = 3 is not a string"),
])
def test_bad_stop_strings_are_typed_errors(m, stop, error, match):
    with pytest.raises(error, match=match) as e:
        m.generate(PROMPTS[0], stop=stop, **GREEDY)
    _one_line(e)


def test_a_second_live_stream_raises_and_the_first_goes_on(m, refs):
    """Issue 19 item 4: interleaved streams used to mix their outputs (B got A's continuation)."""
    a, b = PROMPTS[:2]
    sa = m.stream(a, **GREEDY)
    first = next(sa)
    sb = m.stream(b, **GREEDY)            # arguments are checked; the LLM is taken on first use
    with pytest.raises(LLMBusyError, match="another generation on this LLM is live") as e:
        next(sb)
    _one_line(e)
    with pytest.raises(LLMBusyError):
        m.generate(b, **GREEDY)
    with pytest.raises(LLMBusyError, match="reset"):
        m.reset()
    chunks = [first, *sa]
    assert "".join(c.text for c in chunks) == refs[a].text
    assert chunks[-1].completion.tokens == refs[a].tokens
    # a stream closed half-way frees the LLM too
    sc = m.stream(b, **GREEDY)
    next(sc)
    sc.close()
    assert m.generate(b, **GREEDY).tokens == refs[b].tokens


def test_two_threads_on_one_llm_never_corrupt_it(m, refs):
    """Issue 19 item 3: generations from several threads on one LLM used to fail with
    'Array has been deleted' / donated buffers and leave it broken. Now each call either runs
    alone (same result as alone) or fails at once with LLMBusyError."""
    results: dict[str, object] = {}
    start = threading.Barrier(len(PROMPTS))

    def run(p: str) -> None:
        start.wait()
        try:
            results[p] = m.generate(p, **GREEDY)
        except LLMBusyError as e:
            results[p] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = {p: r for p, r in results.items() if isinstance(r, llm.Completion)}
    assert done and len(results) == len(PROMPTS)
    assert all(isinstance(r, (llm.Completion, LLMBusyError)) for r in results.values())
    for p, r in done.items():
        assert r.tokens == refs[p].tokens
    for p in PROMPTS:
        assert m.generate(p, **GREEDY).tokens == refs[p].tokens


@pytest.mark.slow
def test_a_decode_failing_mid_generation_leaves_the_llm_usable(tiny_path):
    """A failure inside the engine after the KV buffers were donated: GenerationError, then the
    next request runs as on a fresh LLM (the cache was rebuilt and the LLM forgot its prefix)."""
    cb = FailingEval()
    m2 = llm.LLM(tiny_path, n_ctx=128, kv_bucket=32, cb_eval=cb)
    ref = m2.generate(PROMPTS[2], **GREEDY)
    stream = m2.stream(PROMPTS[2], **GREEDY)
    next(stream)
    cb.when = "compute"
    with pytest.raises(llm.api.GenerationError, match="rebuilt empty, sequences \\[0\\] cleared"):
        list(stream)
    assert m2.ctx.last_exception is not None
    cb.when = None
    assert m2.generate(PROMPTS[2], **GREEDY).tokens == ref.tokens


@pytest.mark.slow
def test_no_compile_after_the_first_token(tiny_path):
    """Issue 19 item 11: the KV buckets a generation crosses compile before its first token
    (a 60-token generation crosses n_kv 32 and 64 here), and compile time stays out of the
    prompt's time."""
    import time

    from ggmlx.compile import GraphCache
    m3 = llm.LLM(tiny_path, n_ctx=128, kv_bucket=32)
    m3.ctx.sched.cache = GraphCache()
    t0 = time.perf_counter()
    stream = m3.stream(PROMPTS[3], max_tokens=60, temperature=1.0, seed=3)
    first = next(stream)
    t_first = time.perf_counter() - t0
    n_compiles = m3.ctx.perf()["n_compiles"]
    chunks = [first, *stream]
    c = chunks[-1].completion
    assert c.n_completion_tokens > 40, "the generation must cross KV buckets for this test"
    assert m3.ctx.perf()["n_compiles"] == n_compiles == c.timings["n_compiles"] >= 3
    # compiling and prompt evaluation are disjoint, both before the first token
    assert c.timings["compile_s"] + c.timings["prompt_s"] <= t_first


@pytest.mark.slow
def test_chat_without_a_template_warns_once_and_chat_defaults_to_an_instruct_model(tiny_path, caplog):
    """Issue 19 item 12: chat on a base model warns in one line naming a model with a
    template; the CLI's chat defaults to that instruction-tuned model."""
    from llm import hub
    from llm.cli import commands as cli
    m4 = llm.LLM(tiny_path, n_ctx=128)
    with caplog.at_level(logging.WARNING, logger="llm.api"):
        m4.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
        m4.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "llm.api"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "tiny.gguf has no chat template" in warnings[0] and "llm.LLM('smollm2-135m')" in warnings[0]
    assert hub.DEFAULT_CHAT_MODEL == "smollm2-135m"
    assert cli.build_parser().parse_args(["chat"]).model == "smollm2-135m"
    assert cli.build_parser().parse_args(["generate", "-p", "x"]).model == hub.DEFAULT_MODEL


@pytest.mark.slow
def test_two_threads_embedding_on_one_llm(m):
    """LLM.embed clears its context before each group: calls from several threads take turns."""
    import numpy as np
    texts = [PROMPTS[i % len(PROMPTS)] + " again" * (i % 3) for i in range(12)]
    ref = m.embed(texts, max_seqs=2)
    results: list = []
    start = threading.Barrier(3)

    def run() -> None:
        start.wait()
        try:
            results.append(m.embed(texts, max_seqs=2))
        except Exception as e:  # noqa: BLE001 - the test reports any failure below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for r in results:
        assert isinstance(r, np.ndarray), r
        np.testing.assert_allclose(r, ref, atol=1e-5)
