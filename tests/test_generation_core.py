"""The generation core (llm/generation): one loop for LLM.generate/stream, the batcher and the
server, so what one path can do the others can (schema-constrained batches, interventions on
several sequences, speculative decoding batched and per request); and one declaration per
parameter (llm/params.py): the CLI's --help, LLM.generate's signature, Context's signature and
the server's request defaults all come from SamplingParams / ContextParams."""
from __future__ import annotations

import dataclasses
import inspect
import json

import jsonschema
import numpy as np
import pytest
from starlette.testclient import TestClient
from tiny_model import TinySpec, write_model

import llm
from llm import params
from llm.cli import commands as cli
from llm.context import ContextParams
from llm.generation.core import GenParams, SeqState
from llm.sampling.samplers import LLAMA_DEFAULT_SEED, SamplingParams
from llm.serving import Engine
from llm.serving.app import create_app
from llm.serving.requests import sampling_params

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("core") / "tiny.gguf", TinySpec(seed=5))


@pytest.fixture(scope="module")
def m(tiny_path) -> llm.LLM:
    return llm.LLM(tiny_path, n_ctx=512, n_seq_max=2, kv_bucket=64)


@pytest.fixture(scope="module")
def m1(tiny_path) -> llm.LLM:
    return llm.LLM(tiny_path, n_ctx=256, kv_bucket=64)


# ---- one declaration per parameter -------------------------------------------------------------

def test_generate_signature_is_derived_from_sampling_params():
    for fn in (llm.LLM.generate, llm.LLM.stream):
        sig = inspect.signature(fn).parameters
        for f, arg in params.fields_of(SamplingParams):
            name = params.name_of(f, arg)
            assert sig[name].kind == inspect.Parameter.KEYWORD_ONLY, (fn.__name__, name)
            assert sig[name].default == params.default_of(f), (fn.__name__, name)
    assert "temperature" in inspect.signature(llm.LLM.generate).parameters     # llama-server's names


def test_context_and_llm_signatures_are_derived_from_context_params():
    for fn in (llm.Context.__init__, llm.LLM.__init__):
        sig = inspect.signature(fn).parameters
        for f, arg in params.fields_of(ContextParams):
            assert sig[params.name_of(f, arg)].default == params.default_of(f), (fn.__qualname__, f.name)


def test_cli_flags_and_help_are_derived_from_sampling_params(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f, arg in params.fields_of(SamplingParams):
        assert arg.flags, f"{f.name}: every llama.cpp sampler setting has a flag"
        assert arg.flags[0] in text, f.name
    a = cli.build_parser().parse_args(["generate", "-p", "x"])
    assert params.from_namespace(SamplingParams, a) == SamplingParams()
    a = cli.build_parser().parse_args(["generate", "-p", "x", "--mirostat", "2", "--mirostat-ent", "3",
                                       "--dry-multiplier", "0.8", "--dry-sequence-breaker", "none",
                                       "--samplers", "top_k;temperature", "-l", "15+1.5", "--typical", "0.9"])
    sp = params.from_namespace(SamplingParams, a)
    assert (sp.mirostat, sp.mirostat_tau, sp.dry_multiplier, sp.dry_sequence_breakers, sp.samplers,
            sp.logit_bias, sp.typ_p) == (2, 3.0, 0.8, (), ("top_k", "temperature"), {15: 1.5}, 0.9)


def test_server_defaults_and_fields_are_derived_from_sampling_params():
    assert sampling_params({}, 100) == SamplingParams()
    body = {params.name_of(f, arg): params.default_of(f) for f, arg in params.fields_of(SamplingParams)
            if f.name != "logit_bias"}
    body.update(typical_p=0.5, mirostat=1, dynatemp_range=0.3, xtc_probability=0.2, top_n_sigma=1.5,
                dry_multiplier=0.7, repeat_last_n=-1, samplers=["min_p", "temperature"])
    sp = sampling_params(body, 100)
    assert (sp.typ_p, sp.mirostat, sp.dynatemp_range, sp.xtc_probability, sp.top_n_sigma, sp.dry_multiplier,
            sp.penalty_last_n, sp.samplers) == (0.5, 1, 0.3, 0.2, 1.5, 0.7, -1, ("min_p", "temperature"))
    assert SamplingParams().seed == SamplingParams(seed=-1).seed == LLAMA_DEFAULT_SEED


def test_bad_keywords_are_typed_errors_naming_them(m1):
    with pytest.raises(TypeError, match="'temprature'.*temperature"):
        m1.generate("x", temprature=0.5)
    with pytest.raises(ValueError, match="'repeat_last_n' must be >= -1"):
        m1.generate("x", repeat_last_n=-2)
    with pytest.raises(TypeError, match="'n_ctxx'"):
        llm.Context(m1.model, n_ctxx=64)


# ---- one stop matcher ------------------------------------------------------------------------

def test_seq_state_holds_back_a_stop_string_and_cuts_it(m):
    v = m.vocab
    toks = v.tokenize("hello world, stop here", add_special=False)
    st = SeqState(GenParams(max_tokens=100, stop=["stop"]), v)
    out = []
    for t in toks:
        out.append(st.push(t))
        if st.done:
            break
    assert out[-1].finish_reason == "stop" and out[-1].tokens
    assert "".join(d.text for d in out).lstrip() == "hello world, "
    assert st.tokens == toks[:len(out)]      # the token that completed the stop string is kept


# ---- what the one loop gives every caller ---------------------------------------------------------

@pytest.mark.slow
def test_batched_generate_with_a_json_schema_gives_schema_valid_completions(m):
    out = m.generate(["Person:", "Another person:"], max_tokens=64, json_schema=SCHEMA, temperature=1.0, seed=3)
    assert len(out) == 2
    for c in out:
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.slow
def test_interventions_work_with_several_sequences(m, m1):
    prompts = ["once upon a time", "the quick brown fox"]

    def scale(x):
        return x * 0.5

    iv = {"l_out-0": scale}
    singles = [m1.generate(p, max_tokens=6, interventions=iv, **GREEDY) for p in prompts]
    plain = [m1.generate(p, max_tokens=6, **GREEDY) for p in prompts]
    batch = m.generate(prompts, max_tokens=6, interventions=iv, **GREEDY)
    assert [c.tokens for c in batch] == [c.tokens for c in singles]
    assert [c.tokens for c in singles] != [c.tokens for c in plain]     # the intervention did something


@pytest.mark.slow
def test_speculative_decoding_batched_is_greedy_identical(m, m1):
    prompts = ["a b c d a b c d a b c d a b", "one two three one two three one two"]
    ref = m.generate(prompts, max_tokens=24, **GREEDY)
    spec = m.generate(prompts, max_tokens=24, speculative="prompt-lookup", **GREEDY)
    assert [c.tokens for c in spec] == [c.tokens for c in ref]
    assert spec[0].timings["spec_steps"] > 0
    single = m1.generate(prompts[0], max_tokens=24, speculative="prompt-lookup", **GREEDY)
    assert single.tokens == ref[0].tokens


@pytest.mark.slow
def test_stream_chunks_join_to_the_completion_with_logprobs(m1):
    chunks = list(m1.stream("hello there", max_tokens=12, logprobs=True, top_logprobs=2, **GREEDY))
    done = chunks[-1].completion
    assert done is not None and done.logprobs is not None and len(done.logprobs) == len(done.tokens)
    assert "".join(c.text for c in chunks) == done.text
    assert [c.token for c in chunks[:-1]] == done.tokens[:len(chunks) - 1]
    lp = done.logprobs[0]
    assert lp.top[0][0] == done.tokens[0] and np.isclose(lp.top[0][1], lp.logprob)


@pytest.mark.slow
def test_server_accepts_speculative(m):
    engine = Engine(m.ctx, m.vocab, n_slots=2).start()
    try:
        with TestClient(create_app(m, engine, model_name="tiny")) as c:
            body = {"prompt": "a b c d a b c d a b c d", "max_tokens": 16, "temperature": 0.0}
            ref = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            r = c.post("/v1/completions", json={**body, "speculative": "prompt-lookup"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref
            r = c.post("/v1/completions", json={**body, "speculative": "draft-model"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
            r = c.post("/v1/completions", json={**body, "mirostat": 2, "mirostat_tau": 3.0, "seed": 1})
            assert r.status_code == 200, r.text
    finally:
        engine.stop()
        m.reset()


def test_gen_params_fields_are_declared():
    declared = {f.name for f, _ in params.fields_of(GenParams)}
    assert {"max_tokens", "n", "logprobs", "top_logprobs"} <= declared
    assert {f.name for f in dataclasses.fields(GenParams)} >= declared
