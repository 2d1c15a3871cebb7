"""WPM (BERT WordPiece), UGM (T5 Unigram) and Gemma 4's SPM-style BPE (raw UTF-8, spaces as
U+2581, <0xXX> byte fallback, whole newline runs) tokenizers against llama.cpp.

tests/data/fixtures/tokenizer-<kind>.gguf holds a synthetic vocabulary built from the corpus of
tests/data/tokenizer (benchmarks/reference/make_fixture.py --tokenizers), and
tokenizer-<kind>.jsonl.gz llama.cpp's tokenize ids for every corpus text with the four
add_special / parse_special combinations, plus detokenize bytes of the ids for the four
remove_special / unparse_special combinations."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import llm
from ggmlx import gguf
from llm.loader import GGUFMeta
from llm.vocab import VocabType, load_vocab

FIXTURES = Path(__file__).parent / "data" / "fixtures"
KINDS = {"wpm": VocabType.WPM, "ugm": VocabType.UGM, "gemma4": VocabType.BPE}


def rows(kind: str) -> list[dict]:
    return [json.loads(line) for line in gzip.open(FIXTURES / f"tokenizer-{kind}.jsonl.gz", "rt", encoding="utf-8")]


@pytest.fixture(scope="module", params=sorted(KINDS))
def case(request):
    path = FIXTURES / f"tokenizer-{request.param}.gguf"
    with gguf.GGUFReader(path) as f:
        vocab = load_vocab(GGUFMeta(f.kv, str(path)))
    return request.param, vocab, rows(request.param)


def test_vocab_type(case):
    kind, vocab, _ = case
    assert vocab.type == KINDS[kind]


def test_tokenize_matches_llamacpp(case):
    kind, vocab, data = case
    bad = []
    for r in data:
        ours = vocab.tokenize(r["text"], r["add_special"], r["parse_special"])
        if ours != r["ids"]:
            bad.append((r["text"][:40], r["add_special"], r["parse_special"], ours[:12], r["ids"][:12]))
    assert len(data) == 4 * 159
    assert not bad, f"{len(bad)} of {len(data)} differ, first: {bad[:3]}"


def test_detokenize_matches_llamacpp(case):
    kind, vocab, data = case
    n = 0
    for r in data:
        if "detokenize_hex" not in r:
            continue
        for flags, expected in r["detokenize_hex"].items():
            got = vocab.detokenize_bytes(r["ids"], remove_special=flags[0] == "1", unparse_special=flags[1] == "1")
            assert got.hex() == expected, (r["text"][:40], flags, got, bytes.fromhex(expected))
            n += 1
    assert n == 4 * 159


def test_gemma4_always_adds_bos():
    """llama.cpp turns add_bos on for Gemma 4 whatever the file says, and refuses to without a BOS id."""
    path = FIXTURES / "tokenizer-gemma4.gguf"
    with gguf.GGUFReader(path) as f:
        kv = dict(f.kv)
    kv["tokenizer.ggml.add_bos_token"] = False
    vocab = load_vocab(GGUFMeta(kv, str(path)))
    assert vocab.flags.add_bos and vocab.tokenize("hi")[0] == vocab.bos == 2
    del kv["tokenizer.ggml.bos_token_id"]
    with pytest.raises(llm.ModelLoadError, match="tokenizer.ggml.bos_token_id"):
        load_vocab(GGUFMeta(kv, str(path)))
