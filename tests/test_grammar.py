"""Grammar-constrained sampling (llm.gbnf, llm.grammar): GBNF accept/reject cases
(tests/data/grammar/gbnf_cases.json), invalid grammars and schemas failing before decoding,
the vocabulary as bytes, and the Grammar sampler in a chain on a tiny model."""
from __future__ import annotations

import json
import time
from pathlib import Path

import llguidance
import numpy as np
import pytest
from tiny_model import TinySpec, write_model

import llm
import llm.sampling as sampling
from llm.sampling import structured as G
from llm.sampling.samplers import SamplerChain, SamplingParams

CASES = json.loads((Path(__file__).parent / "data" / "grammar" / "gbnf_cases.json").read_text())
EOS = 256


class _Bytes:
    """A vocabulary of the 256 single bytes plus an end token: acceptance is then exactly the
    grammar's, whatever a real tokenizer would split."""

    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=EOS)


def accepts(spec: G.GrammarSpec, text: str) -> bool:
    m = llguidance.LLMatcher(BYTES, spec.grammar, log_level=0)
    for b in text.encode("utf-8"):
        if not m.consume_token(b):
            return False
    return m.is_accepting()


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_gbnf_accepts_and_rejects(case):
    spec = sampling.grammar(case["grammar"], root=case.get("root", "root"))
    for text in case["accept"]:
        assert accepts(spec, text), f"{case['name']}: should accept {text!r}"
    for text in case["reject"]:
        assert not accepts(spec, text), f"{case['name']}: should reject {text!r}"


@pytest.mark.parametrize("case", CASES["invalid"], ids=[c["error"] for c in CASES["invalid"]])
def test_invalid_gbnf_raises(case):
    with pytest.raises(llm.GrammarError, match=case["error"].replace("(", r"\(").replace(")", r"\)")):
        sampling.grammar(case["grammar"])


def test_huge_and_deep_grammars_fail_or_finish_quickly():
    t0 = time.perf_counter()
    with pytest.raises(llm.GrammarError, match="more than"):
        sampling.grammar('root ::= "' + "a" * (5 << 20) + '"')
    with pytest.raises(llm.GrammarError, match="nested deeper"):
        sampling.grammar("root ::= " + "(" * 10000 + '"a"' + ")" * 10000)
    # 5,000 alternatives of 1,000 rules: builds (or is refused) within a few seconds
    rules = "\n".join(f'r{i} ::= "w{i}" | r{i + 1}' for i in range(1000)) + '\nr1000 ::= "end"'
    spec = sampling.grammar("root ::= r0\n" + rules)
    assert accepts(spec, "w17") and accepts(spec, "end") and not accepts(spec, "w1000")
    # a cyclic, ambiguous grammar (root -> root) still terminates
    spec = sampling.grammar('root ::= root | "a" root | "b"')
    assert accepts(spec, "aab") and not accepts(spec, "aa")
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("schema,error", [
    ({"type": "strin"}, "invalid schema"),
    ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "invalid schema"),
    ({"type": "object", "required": "a"}, "invalid schema"),
    ("{not json", "not valid JSON"),
    ([1, 2], "expected a JSON object"),
    ({"type": "string", "pattern": "(unclosed"}, "json_schema"),
])
def test_invalid_schema_raises(schema, error):
    with pytest.raises(llm.GrammarError, match=error):
        sampling.json_schema(schema)


@pytest.mark.slow
def test_huge_schema_fails_or_finishes_quickly():
    props = {f"field_{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(20)]} for i in range(4000)}
    schema = {"type": "object", "properties": props, "required": list(props)[:10]}
    assert len(json.dumps(schema)) > 1_000_000
    t0 = time.perf_counter()
    try:
        sampling.json_schema(schema)
    except llm.GrammarError:
        pass
    assert time.perf_counter() - t0 < 30


# ---- on a real (tiny) vocabulary ----------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llm.load_model(write_model(tmp_path_factory.mktemp("g") / "tiny.gguf", TinySpec(seed=4)))


@pytest.fixture(scope="module")
def gvocab(model):
    return G.GrammarVocab(model.vocab)


def test_token_bytes_round_trip(model):
    pieces = G.token_bytes(model.vocab)
    assert G.check_token_bytes(model.vocab, pieces) == []
    v = model.vocab
    byte_tokens = [t for t in range(v.n_tokens) if v.is_byte(t)]
    assert byte_tokens and all(len(pieces[t]) == 1 for t in byte_tokens)
    assert all(pieces[t].startswith(b"\xff") for t in range(v.n_tokens) if v.is_control(t))
    text = "hello world"
    assert b"".join(pieces[t] for t in v.tokenize(text, add_special=False)).lstrip(b" ") == text.encode()


def run_constrained(model, gvocab, spec, *, seed, temp, max_tokens=48):
    ctx = llm.Context(model, n_ctx=128, kv_bucket=128)
    chain = SamplerChain.from_params(SamplingParams(seed=seed, temp=temp), n_vocab=model.n_vocab)
    chain.samplers.insert(0, spec.sampler(gvocab))
    assert ctx.decode(llm.Batch.get_one([model.vocab.bos])) == 0
    out, pos = [], 1
    for _ in range(max_tokens):
        tok = chain.sample(ctx)
        if model.vocab.is_eog(tok):
            return out, True
        out.append(tok)
        assert ctx.decode(llm.Batch([tok], pos=[pos])) == 0
        pos += 1
    return out, False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_keeps_random_model_in_grammar(model, gvocab, seed):
    spec = sampling.grammar('root ::= "{" [a-z]{1,4} ":" [0-9]{1,2} "}"')
    tokens, ended = run_constrained(model, gvocab, spec, seed=seed, temp=1.5)
    text = model.vocab.detokenize(tokens).lstrip(" ")
    assert ended, text
    assert accepts(spec, text), text


def test_unfinishable_grammar_stops_at_max_tokens(model, gvocab):
    spec = sampling.grammar('root ::= "a"+ "!"')
    t0 = time.perf_counter()
    tokens, ended = run_constrained(model, gvocab, spec, seed=3, temp=1.0, max_tokens=12)
    # the random model may or may not reach "!"; either way generation stops by itself
    assert len(tokens) <= 12 and time.perf_counter() - t0 < 60


def test_grammar_first_in_chain_and_clone(model, gvocab):
    spec = sampling.grammar('root ::= "ab"')
    g = spec.sampler(gvocab)
    cur = sampling.TokenDataArray.from_logits(np.zeros(model.n_vocab, np.float32))
    g.apply(cur)
    allowed = np.flatnonzero(np.isfinite(cur.logits))
    assert allowed.size > 0
    assert all(b"ab".startswith(gvocab.pieces[t].lstrip(b" ")) or gvocab.pieces[t] == b"ab" for t in allowed)
    twin = g.clone()
    g.accept(int(allowed[0]))
    assert twin.allowed().sum() == allowed.size        # the clone did not move
