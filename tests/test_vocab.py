"""llm.vocab against llama.cpp: vocab metadata, tokenize, pieces and detokenize of both real
models (reference data in tests/data/tokenizer, see regenerate.py there), the synthetic
models' SPM vocabulary, hand-built vocabularies for the merge rules, and load errors."""
from __future__ import annotations

import base64
import collections
import functools
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from reference import reference_dir

from ggmlx.gguf import GGUFReader, GGUFValueType, GGUFWriter
from llm import ModelLoadError
from llm.loader import GGUFMeta
from llm.vocab import LLAMA_TOKEN_NULL, TokenAttr, VocabType, load_vocab

DATA = Path(__file__).parent / "data" / "tokenizer"
SHARED = reference_dir()
MODELS = {"smollm2-135m-instruct-q4_1": "smollm2_path", "gemma-3-270m-q4_k_m": "gemma3_path"}


@functools.cache
def _vocab_from_file(path: str):
    return load_vocab(GGUFMeta(GGUFReader(path).kv, str(path)))


@pytest.fixture(params=[pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def model(request):
    """(reference name, Vocab) of each real model."""
    path = request.getfixturevalue(MODELS[request.param])
    return request.param, _vocab_from_file(str(path))


def _jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _block_digests(pieces: list[bytes]) -> np.ndarray:
    """Same digest as tests/data/tokenizer/regenerate.py: BLAKE2b-128 per 1024 ids."""
    out = []
    for start in range(0, len(pieces), 1024):
        h = hashlib.blake2b(digest_size=16)
        for p in pieces[start:start + 1024]:
            h.update(len(p).to_bytes(4, "little") + p)
        out.append(np.frombuffer(h.digest(), dtype=np.uint8))
    return np.stack(out)


# --- the real models against llama.cpp ---------------------------------------------------


def test_vocab_info_matches_llama_cpp(model):
    name, vocab = model
    info = json.loads((DATA / f"{name}.vocab_info.json").read_text())
    assert vocab.n_tokens == info["n_vocab"]
    assert int(vocab.type) == info["vocab_type"]
    assert vocab.tokenizer_model == info["tokenizer_model"]
    assert vocab.tokenizer_pre == info["tokenizer_pre"]
    for key in ("bos", "eos", "eot", "sep", "nl", "pad", "add_bos", "add_eos", "add_sep"):
        assert getattr(vocab, key) == info[key], key
    assert sorted(vocab.eog_ids) == info["eog_ids"]
    assert all(vocab.is_eog(t) for t in info["eog_ids"])
    assert not vocab.is_eog(vocab.bos) and not vocab.is_eog(LLAMA_TOKEN_NULL)
    histogram = collections.Counter(int(vocab.token_get_attr(i)) for i in range(vocab.n_tokens))
    assert {str(k): n for k, n in histogram.items()} == info["attr_histogram"]
    assert {int(TokenAttr[v]): v for v in info["attr_bits"].values()} == \
        {int(k): v for k, v in info["attr_bits"].items()}


def test_tokenize_matches_llama_cpp(model):
    name, vocab = model
    rows = _jsonl(DATA / f"{name}.tokenize.jsonl.gz")
    assert len(rows) == 636
    wrong = [(r["text"], r["add_special"], r["parse_special"])
             for r in rows if vocab.tokenize(r["text"], r["add_special"], r["parse_special"]) != r["ids"]]
    assert not wrong, f"{len(wrong)} of {len(rows)} differ, first: {wrong[:3]}"


def test_pieces_match_llama_cpp(model):
    name, vocab = model
    ref = np.load(DATA / f"{name}.pieces_digest.npz")
    n = vocab.n_tokens
    attrs = np.array([int(vocab.token_get_attr(i)) for i in range(n)], dtype=np.int32)
    np.testing.assert_array_equal(attrs, ref["attr"])
    for special, key in ((False, "digest"), (True, "digest_special")):
        got = _block_digests([vocab.token_to_piece(i, special=special) for i in range(n)])
        bad = np.nonzero((got != ref[key]).any(axis=1))[0]
        assert not bad.size, (f"special={special}: pieces differ in token id blocks "
                              f"{[(int(b) * 1024, int(b) * 1024 + 1023) for b in bad[:5]]}")


@pytest.mark.skipif(not (SHARED / "tokenizer").is_dir(), reason="needs the llama.cpp reference (--reference)")
def test_pieces_match_llama_cpp_one_by_one(model):
    name, vocab = model
    wrong = []
    for r in _jsonl(SHARED / "tokenizer" / f"{name}.pieces.jsonl.gz"):
        for special, key in ((False, "piece_b64"), (True, "piece_special_b64")):
            if vocab.token_to_piece(r["id"], special=special) != base64.b64decode(r[key]):
                wrong.append((r["id"], special))
    assert not wrong, wrong[:10]


def test_detokenize_matches_llama_cpp(model):
    name, vocab = model
    rows = _jsonl(DATA / f"{name}.detokenize.jsonl.gz")
    assert len(rows) == 120
    for r in rows:
        assert vocab.tokenize(r["text"], True, True) == r["ids"]
        args = (r["ids"], r["remove_special"], r["unparse_special"])
        assert vocab.detokenize_bytes(*args) == base64.b64decode(r["out_b64"]), r
        if r["out"] is not None:
            assert vocab.detokenize(*args) == r["out"]


def test_detokenize_round_trips_plain_text(model):
    name, vocab = model
    texts = {r["text"] for r in _jsonl(DATA / f"{name}.tokenize.jsonl.gz")}
    for text in texts:
        assert vocab.detokenize(vocab.tokenize(text, add_special=False)) == text


def test_lstrip_in_token_to_piece(model):
    _, vocab = model
    tid = vocab.tokenize(" Hello", add_special=False)[0]
    assert vocab.token_to_piece(tid).startswith(b" ")
    assert vocab.token_to_piece(tid, lstrip=1) == vocab.token_to_piece(tid)[1:]


def test_unusual_input_never_raises(model):
    _, vocab = model
    samples = [b"\xff", b"a\xffb", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80",
               b"\x80\x80\x80", "\ud800 lone surrogate \udfff", "\x00\x1f\x7f", "\U0010ffff\uffff",
               "<|im_start|<bos", "a" * 3000, " " * 300 + "\n" * 40]
    for s in samples:
        for add_special in (False, True):
            for parse_special in (False, True):
                ids = vocab.tokenize(s, add_special, parse_special)
                assert all(0 <= t < vocab.n_tokens for t in ids)
                vocab.detokenize(ids)


def test_invalid_utf8_follows_llama_cpp(model):
    _, vocab = model
    if vocab.type == VocabType.BPE:
        # llama.cpp decodes each stray byte as U+FFFD before pre-tokenizing
        assert vocab.tokenize(b"a\xffb\xc3", False) == vocab.tokenize("a\ufffdb\ufffd", False)
    else:
        # SPM splits at lead bytes: 0xFF announces 4 bytes and swallows "b"
        assert vocab.tokenize(b"a\xffb", False)[-2:] == [vocab.text_to_token("<0xFF>"),
                                                         vocab.text_to_token("<0x62>")]


def test_stream_decoder_never_splits_a_character(model):
    _, vocab = model
    text = "pizza 🍕, 日本語, Ωmega, \U0010ffff and 👨\u200d👩\u200d👧 end"
    ids = vocab.tokenize(text, add_special=False)
    dec = vocab.stream_decoder()
    parts = [dec.push(t) for t in ids] + [dec.flush()]
    assert "".join(parts) == vocab.detokenize(ids) == text
    assert not any("\ufffd" in p for p in parts)
    pieces = [vocab.token_to_piece(t) for t in ids]
    assert any(p and not _is_utf8(p) for p in pieces), "the text should need multi-token characters"


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_special_token_api(model):
    name, vocab = model
    assert vocab.is_control(vocab.bos) and vocab.is_control(vocab.eos)
    assert vocab.text_to_token(vocab.token_get_text(vocab.eos)) == vocab.eos
    assert vocab.text_to_token("definitely not a token \u2603") == LLAMA_TOKEN_NULL
    assert vocab.token_to_piece(vocab.eos) == b""
    assert vocab.token_to_piece(vocab.eos, special=True) == vocab.token_get_text(vocab.eos)
    with pytest.raises(ValueError, match="out of range"):
        vocab.token_to_piece(vocab.n_tokens)
    with pytest.raises(ValueError, match="out of range"):
        vocab.is_control(-1)
    if name.startswith("gemma"):
        assert vocab.is_unused(6) and vocab.token_get_text(6) == b"<unused0>"
        assert vocab.is_byte(vocab.nl) and vocab.token_to_piece(vocab.nl) == b"\n"
        assert vocab.token_get_score(vocab.eot) == -1000.0


# --- the synthetic models' 512-token SPM vocabulary ---------------------------------------


def _synthetic_kv() -> dict:
    return json.loads((DATA / "synth-spm.tokenizer.json").read_text())


def _write_gguf(path: Path, kv: dict) -> Path:
    """A GGUF with these tokenizer keys, typed as convert_hf_to_gguf writes them."""
    types = {"tokenizer.ggml.scores": GGUFValueType.FLOAT32, "tokenizer.ggml.token_type": GGUFValueType.INT32}
    w = GGUFWriter()
    w.add_kv("general.architecture", "llama")
    for key, value in kv.items():
        if key in types:
            w.add_kv(key, value, array_type=types[key])
        elif key.endswith("_token_id"):
            w.add_kv(key, value, vtype=GGUFValueType.UINT32)
        else:
            w.add_kv(key, value)
    w.write(path)
    return path


@pytest.fixture(scope="module")
def synthetic_vocab(tmp_path_factory):
    path = _write_gguf(tmp_path_factory.mktemp("vocab") / "synth-spm.gguf", _synthetic_kv())
    return load_vocab(GGUFMeta(GGUFReader(path).kv, str(path)))


def test_synthetic_vocab_loads(synthetic_vocab):
    v = synthetic_vocab
    assert (v.type, v.n_tokens, v.bos, v.eos, v.unk, v.nl) == (VocabType.SPM, 512, 1, 2, 0, 13)
    assert v.add_bos and not v.add_eos and v.add_space_prefix
    assert v.eog_ids == {2}
    assert v.is_unknown(0) and v.is_control(1) and v.is_byte(3 + 0x41)
    assert v.tokenize("") == [1] and v.tokenize("", add_special=False) == []
    # whole words are tokens, but SPM only reaches them through token bigrams
    sp_a, sp_b, sp_t = (v.text_to_token("\u2581" + c) for c in "abt")
    assert v.tokenize("a b") == [1, sp_a, sp_b]
    assert v.tokenize("the", add_special=False) == [sp_t, v.text_to_token("h"), v.text_to_token("e")]
    assert v.token_to_piece(sp_a) == b" a"


@pytest.mark.parametrize("text", [
    "the world is a hot place", "The World", "  two  spaces ", "line\nbreak\ttab", "",
    "über café 日本 🍕", "<s> and </s> as text", "aaaaaaaaaaaaaaaaaaaa", "x" * 500 + " y",
])
def test_synthetic_vocab_round_trips(synthetic_vocab, text):
    v = synthetic_vocab
    ids = v.tokenize(text, add_special=False)
    assert v.detokenize(ids) == text
    assert v.detokenize([v.bos] + ids, remove_special=True) == (" " + text if text else "")
    if text:     # a generated stream keeps the SPM space prefix that detokenize removes
        dec = v.stream_decoder()
        assert "".join(dec.push(t) for t in ids) + dec.flush() == " " + text


def test_synthetic_special_tokens_need_parse_special(synthetic_vocab):
    v = synthetic_vocab
    assert v.tokenize("</s>", add_special=False, parse_special=True) == [2]
    assert 2 not in v.tokenize("</s>", add_special=False, parse_special=False)
    assert v.detokenize([2], unparse_special=True) == "</s>" and v.detokenize([2]) == ""


@pytest.mark.skipif(not (SHARED / "synthetic").is_dir(), reason="needs the llama.cpp reference (--reference)")
def test_synthetic_model_files_share_the_vocab(synthetic_vocab):
    files = sorted((SHARED / "synthetic" / "models").glob("*.gguf"))
    assert files
    for path in files:
        v = load_vocab(GGUFMeta(GGUFReader(path).kv, str(path)))
        assert v.texts == synthetic_vocab.texts and v.scores == synthetic_vocab.scores, path
        assert v.attrs == synthetic_vocab.attrs and v.special == synthetic_vocab.special, path
        text = "the world is round"
        assert v.detokenize(v.tokenize(text, add_special=False)) == text


# --- hand-built vocabularies: the merge rules ---------------------------------------------


def _spm_kv(tokens: list[str], scores: list[float], **extra) -> dict:
    types = [6 if t.startswith("<0x") else 3 if t in ("<s>", "</s>") else 2 if t == "<unk>" else 1
             for t in tokens]
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
          "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
          "tokenizer.ggml.add_space_prefix": False}
    kv.update(extra)
    return kv


_SPM_BASE = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "a", "b", "c", "\u2581"]


@pytest.mark.parametrize("ab, bc, abc, expected", [
    (-1.0, -2.0, None, ["ab", "c"]),      # higher score first
    (-2.0, -1.0, None, ["a", "bc"]),
    (-1.0, -1.0, None, ["ab", "c"]),      # tie: the leftmost pair
    (-2.0, -1.0, -5.0, ["abc"]),          # "a"+"bc" is a token too: merged further
])
def test_spm_merges_by_score(ab, bc, abc, expected):
    tokens, scores = list(_SPM_BASE), [0.0] * len(_SPM_BASE)
    for text, score in (("ab", ab), ("bc", bc), ("abc", abc)):
        if score is not None:
            tokens.append(text)
            scores.append(score)
    v = load_vocab(GGUFMeta(_spm_kv(tokens, scores)))
    assert [v.token_get_text(t).decode() for t in v.tokenize("abc", add_special=False)] == expected


def test_spm_byte_fallback_and_space_escape():
    tokens = _SPM_BASE + ["\u2581a"]
    v = load_vocab(GGUFMeta(_spm_kv(tokens, [0.0] * len(tokens))))
    assert v.tokenize("é a", add_special=False) == [3 + 0xC3, 3 + 0xA9, len(tokens) - 1]
    assert v.detokenize(v.tokenize("é a", add_special=False)) == "é a"


def test_spm_add_space_prefix_after_special_tokens():
    tokens = _SPM_BASE + ["\u2581a"]
    kv = _spm_kv(tokens, [0.0] * len(tokens))
    kv["tokenizer.ggml.add_space_prefix"] = True
    v = load_vocab(GGUFMeta(kv))
    space_a = len(tokens) - 1
    assert v.tokenize("a</s>a", add_special=False, parse_special=True) == [space_a, 2, space_a]
    assert v.detokenize([space_a, 2, space_a]) == "a a"


def _bpe_kv(tokens: list[str], merges: list[str], pre: str = "gpt-2", **extra) -> dict:
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": np.array([3 if t.startswith("<|") else 1 for t in tokens], dtype=np.int32)}
    kv.update(extra)
    return kv


@pytest.mark.parametrize("merges, expected", [
    (["a b", "b c"], ["ab", "c"]),        # lowest rank first
    (["b c", "a b"], ["a", "bc"]),
    (["b c", "a bc"], ["abc"]),
    (["a b", "a b", "b c"], ["ab", "c"]),  # a repeated merge keeps its first rank
])
def test_bpe_merges_by_rank(merges, expected):
    tokens = ["<|endoftext|>", "a", "b", "c", "ab", "bc", "abc"]
    v = load_vocab(GGUFMeta(_bpe_kv(tokens, merges)))
    assert [v.token_get_text(t).decode() for t in v.tokenize("abc")] == expected
    assert v.bos == LLAMA_TOKEN_NULL          # BPE's default BOS id 11 is out of range here


def test_bpe_unknown_symbols_become_known_bytes_or_vanish():
    tokens = ["<|endoftext|>", "a", "b", "\u0120"]        # Ġ is the byte-level space
    v = load_vocab(GGUFMeta(_bpe_kv(tokens, [])))
    assert v.tokenize("ab c a") == [1, 2, 3, 3, 1]        # "c" is no token: dropped, as in llama.cpp
    assert v.eot == 0 and v.eog_ids == {0}                # "<|endoftext|>" recognized by its text
    assert v.detokenize([1, 3, 2]) == "a b"


def test_bpe_ignore_merges_for_llama3():
    tokens = ["<|endoftext|>", "h", "e", "l", "o", "he", "hello"]
    kv = _bpe_kv(tokens, ["h e"], pre="llama-bpe", **{"tokenizer.ggml.bos_token_id": 0})
    v = load_vocab(GGUFMeta(kv))
    assert v.tokenize("hello", add_special=False) == [6]   # whole word is a token: no merging
    assert v.add_bos and v.tokenize("hello") == [0, 6]
    v = load_vocab(GGUFMeta(_bpe_kv(tokens, ["h e"], pre="gpt-2")))
    assert v.tokenize("hello") == [5, 3, 3, 4]


def test_clean_spaces_on_detokenize():
    tokens = ["<|endoftext|>", "a", "\u0120", "'", "s", ".", "\u0120'"]
    v = load_vocab(GGUFMeta(_bpe_kv(tokens, [], pre="gpt-2")))      # gpt-2: clean_spaces on
    ids = v.tokenize("a 's a . a ' a")
    assert v.detokenize(ids) == "a's a. a'a"
    v = load_vocab(GGUFMeta(_bpe_kv(tokens, [], pre="qwen2")))      # qwen2: off
    assert v.detokenize(v.tokenize("a 's a . a ' a")) == "a 's a . a ' a"


def test_phi3_strips_spaces_around_special_tokens():
    tokens = _SPM_BASE + ["<|endoftext|>", "<|end|>", "\u2581a", "\u2581\u2581"]
    kv = _spm_kv(tokens, [0.0] * len(tokens), **{"general.name": "Phi3 mini"})
    kv["tokenizer.ggml.token_type"][len(_SPM_BASE):len(_SPM_BASE) + 2] = 3
    v = load_vocab(GGUFMeta(kv))
    end = v.text_to_token("<|end|>")
    assert v.token_get_attr(end) & TokenAttr.RSTRIP
    assert not v.token_get_attr(v.text_to_token("<|endoftext|>")) & TokenAttr.RSTRIP
    ids = v.tokenize("a<|end|>  a", add_special=False, parse_special=True)
    assert ids == [v.text_to_token("a"), end, v.text_to_token("a")]
    del kv["tokenizer.ggml.token_type"]
    kv["tokenizer.ggml.tokens"] = [t for t in tokens if t != "<|endoftext|>"]
    kv["tokenizer.ggml.scores"] = kv["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ModelLoadError, match="<\\|endoftext\\|>"):
        load_vocab(GGUFMeta(kv))


# --- load errors ----------------------------------------------------------------------------


def _good_kv() -> dict:
    return _spm_kv(list(_SPM_BASE), [0.0] * len(_SPM_BASE))


@pytest.mark.parametrize("change, message", [
    (lambda kv: kv.pop("tokenizer.ggml.model"), "missing required key 'tokenizer.ggml.model'"),
    (lambda kv: kv.update({"tokenizer.ggml.model": "rwkv"}), "'rwkv' is not supported yet"),
    (lambda kv: kv.update({"tokenizer.ggml.model": "plamo2"}), "'plamo2' is not supported yet"),
    (lambda kv: kv.update({"tokenizer.ggml.model": 7}), "'tokenizer.ggml.model' has a value of type int"),
    (lambda kv: kv.pop("tokenizer.ggml.tokens"), "missing required key 'tokenizer.ggml.tokens'"),
    (lambda kv: kv.update({"tokenizer.ggml.tokens": "abc"}), "'tokenizer.ggml.tokens'.*array of strings"),
    (lambda kv: kv.update({"tokenizer.ggml.scores": np.zeros(3, np.float32)}),
     "'tokenizer.ggml.scores' has 3 values for 263 tokens"),
    (lambda kv: kv.update({"tokenizer.ggml.token_type": np.zeros(263, np.float32)}),
     "'tokenizer.ggml.token_type'.*array of integers"),
    (lambda kv: kv.update({"tokenizer.ggml.bos_token_id": "1"}), "'tokenizer.ggml.bos_token_id'.*expected an integer"),
    (lambda kv: kv.update({"tokenizer.ggml.add_bos_token": 1}), "'tokenizer.ggml.add_bos_token'.*a bool"),
    (lambda kv: kv.update({"tokenizer.ggml.add_sep_token": True}),
     "'tokenizer.ggml.add_sep_token' is true, but 'tokenizer.ggml.seperator_token_id' is not set"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(262, "a"), "duplicate token b'a' with ids 259 and 262"),
])
def test_load_errors_name_the_key(change, message):
    kv = _good_kv()
    change(kv)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_vocab(GGUFMeta(kv, "model.gguf"))
    assert str(e.value).startswith("model.gguf: ")


def test_bpe_load_errors():
    with pytest.raises(ModelLoadError, match="missing required key 'tokenizer.ggml.merges'"):
        load_vocab(GGUFMeta({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}))
    with pytest.raises(ModelLoadError, match="unknown or unsupported pre-tokenizer type 'no-such-pre'"):
        load_vocab(GGUFMeta(_bpe_kv(["a"], [], pre="no-such-pre")))
    v = load_vocab(GGUFMeta({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
                             "tokenizer.ggml.merges": []}))
    assert v.tokenizer_pre == "default" and v.bos == LLAMA_TOKEN_NULL   # default 11 is out of range


def test_out_of_range_special_ids_keep_the_default():
    kv = _good_kv()
    kv["tokenizer.ggml.eos_token_id"] = 100000
    kv["tokenizer.ggml.unknown_token_id"] = 0
    v = load_vocab(GGUFMeta(kv))
    assert v.eos == 2 and v.unk == 0 and v.eot == LLAMA_TOKEN_NULL


def test_load_vocab_only_model(smollm2_path):
    import llm
    model = llm.load_model(smollm2_path, vocab_only=True)
    assert model.vocab.tokenize("Hello world") == _vocab_from_file(str(smollm2_path)).tokenize("Hello world")


def _cut_bytes_one_by_one(texts: list[bytes]) -> set[int]:
    """The bytes that precede a "▁" inside a token, found token by token (the definition)."""
    esc = "\u2581".encode()
    before = set()
    for text in texts:
        i = text.find(esc, 1)
        while i != -1:
            before.add(text[i - 1])
            i = text.find(esc, i + 1)
    return before


def test_spm_cut_pattern_matches_the_token_by_token_definition():
    """_cut_pattern scans all the texts joined at once; the bytes it finds before an inner "▁"
    are those of a scan token by token, with newlines, "▁▁" and "▁" at a text's start."""
    import re

    from llm.tokenizers.spm import _cut_pattern
    esc = "\u2581".encode()
    rng = np.random.default_rng(7)
    alphabet = [b"a", b"\n", b"\xe2", b"\x96", b"\x81", esc, b"x", b"\x00"]
    for _ in range(100):
        texts = list(dict.fromkeys(b"".join(alphabet[k] for k in rng.integers(0, len(alphabet), rng.integers(0, 6)))
                                   for _ in range(rng.integers(0, 40))))
        want = _cut_bytes_one_by_one(texts)
        klass = b"".join(re.escape(bytes([b])) for b in sorted(want))
        expected = b"(?<![" + klass + b"])" + re.escape(esc) if want else re.escape(esc)
        assert _cut_pattern(dict.fromkeys(texts, 0)).pattern == expected, texts


def test_token_types_map_to_attributes_and_others_to_undefined():
    from llm.vocab import TokenType, _attrs_of_types
    types = [int(t) for t in TokenType] + [7, -1, 2**31 - 1]
    want = [0, TokenAttr.NORMAL, TokenAttr.UNKNOWN, TokenAttr.CONTROL, TokenAttr.USER_DEFINED, TokenAttr.UNUSED,
            TokenAttr.BYTE, 0, 0, 0]
    assert _attrs_of_types(types) == [int(a) for a in want]
    assert _attrs_of_types([]) == []


def test_a_vocabulary_is_read_back_from_the_cache_until_its_file_changes(tmp_path, monkeypatch, caplog):
    """load_vocab_cached stores what load_vocab built and gives it back for the same file (the
    same tokens, ids and tokenization, load_vocab not called); a rewritten file, or a damaged
    entry (a warning), builds it again."""
    import os

    from llm import vocab as vocab_mod
    from tests import tiny_model
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("GGMLX_NO_PERSISTENT_CACHE", raising=False)
    path = tiny_model.write_model(tmp_path / "tiny.gguf")
    built = []
    real = vocab_mod.load_vocab

    def counting(ml):
        built.append(ml.path)
        return real(ml)

    monkeypatch.setattr(vocab_mod, "load_vocab", counting)

    def load():
        return vocab_mod.load_vocab_cached(GGUFMeta(GGUFReader(path).kv, str(path)))

    first = load()
    (entry,) = (tmp_path / "c" / "vocab").glob("*.pkl")
    second = load()
    assert len(built) == 1
    assert second.texts == first.texts and second.token_to_id == first.token_to_id
    assert second.special == first.special and second.eog_ids == first.eog_ids
    text = "the quick brown fox"
    assert second.tokenize(text) == first.tokenize(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))      # the file changed: built again
    load()
    assert len(built) == 2 and len(list((tmp_path / "c" / "vocab").glob("*.pkl"))) == 2
    new_entry = next(p for p in (tmp_path / "c" / "vocab").glob("*.pkl") if p != entry)
    new_entry.write_bytes(b"not a pickle")
    with caplog.at_level("WARNING", logger="llm.vocab"):
        again = load()
    assert len(built) == 3 and again.texts == first.texts
    assert "unreadable cached vocabulary" in caplog.text
    assert load().texts == first.texts and len(built) == 3        # written again by the rebuild


def test_the_vocabulary_cache_is_off_with_the_persistent_caches(tmp_path, monkeypatch):
    from llm import vocab as vocab_mod
    from tests import tiny_model
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("GGMLX_NO_PERSISTENT_CACHE", "1")
    path = tiny_model.write_model(tmp_path / "tiny.gguf")
    vocab_mod.load_vocab_cached(GGUFMeta(GGUFReader(path).kv, str(path)))
    assert not (tmp_path / "c").exists()


FIXTURE_DIR = Path(__file__).parent / "data" / "fixtures"


@pytest.mark.parametrize("name", ["apertus-F32.gguf", "bert-F32.gguf", "tokenizer-gemma4.gguf", "tokenizer-ugm.gguf",
                                  pytest.param("smollm2_path", marks=pytest.mark.slow)])
def test_every_tokenizer_comes_back_from_the_cache_the_same(name, tmp_path, monkeypatch, request):
    """SPM, WPM, Gemma 4's BPE, UGM and byte-level BPE (SmolLM2) vocabularies: the cached copy has
    the same tokens and tokenizes and detokenizes the same."""
    from llm import vocab as vocab_mod
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("GGMLX_NO_PERSISTENT_CACHE", raising=False)
    path = request.getfixturevalue(name) if name.endswith("_path") else FIXTURE_DIR / name
    meta = GGUFMeta(GGUFReader(path).kv, str(path))
    built = vocab_mod.load_vocab_cached(meta)
    monkeypatch.setattr(vocab_mod, "load_vocab", lambda ml: pytest.fail("built again instead of read back"))
    cached = vocab_mod.load_vocab_cached(meta)
    assert cached.texts == built.texts and cached.type == built.type and cached.special == built.special
    for text in ("Hello world, the quick brown fox!", "  spaces\tand\nlines 12345", "ümlaut café 日本語"):
        ids = built.tokenize(text, add_special=True, parse_special=True)
        assert cached.tokenize(text, add_special=True, parse_special=True) == ids
        assert cached.detokenize(ids) == built.detokenize(ids)
