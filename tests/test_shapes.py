"""benchmarks/shapes.py: the shape table, the byte-level BPE vocabulary and the streamed F16
writer, on a tiny shape (the 1B/3B/8B files are built by benchmarks/compare.py --shape)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import llm
from ggmlx.gguf import GGUFReader
from ggmlx.types import GGMLType

_spec = importlib.util.spec_from_file_location("shapes", Path(__file__).parents[1] / "benchmarks" / "shapes.py")
assert _spec is not None and _spec.loader is not None
shapes = importlib.util.module_from_spec(_spec)
sys.modules["shapes"] = shapes         # dataclasses look their module up there
_spec.loader.exec_module(shapes)

TINY = shapes.Shape(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_vocab=600, tied=False,
                    rope_factor=8.0, n_ctx_train=256, n_special=8)


def n_params(s) -> int:
    n_kv = s.n_head_kv * s.head_dim
    block = 2 * s.n_embd * s.n_embd + 2 * s.n_embd * n_kv + 3 * s.n_embd * s.n_ff + 2 * s.n_embd
    return s.n_layer * block + s.n_vocab * s.n_embd * (1 if s.tied else 2) + s.n_embd


@pytest.mark.parametrize("name, billions", [("1b", 1.236), ("3b", 3.213), ("8b", 8.030)])
def test_table_has_the_models_parameter_counts(name, billions):
    assert n_params(shapes.SHAPES[name]) / 1e9 == pytest.approx(billions, abs=0.001)


def test_vocabulary_is_byte_level_bpe_of_the_size():
    tokens, types, merges = shapes.bpe_vocab(TINY.n_vocab, TINY.n_special)
    assert len(tokens) == len(set(tokens)) == len(types) == TINY.n_vocab
    assert len(merges) == TINY.n_vocab - TINY.n_special - 256
    have = set(tokens)
    for m in merges:            # both parts and the result are tokens, as llama.cpp's BPE needs
        a, b = m.split(" ")
        assert a in have and b in have and a + b in have
    assert types.count(3) == TINY.n_special and tokens[-TINY.n_special] == "<|begin_of_text|>"
    with pytest.raises(ValueError, match="n_vocab 100"):
        shapes.bpe_vocab(100, 8)


def test_llama3_rope_factors_span_one_to_the_factor():
    f = shapes.llama3_rope_factors(shapes.SHAPES["8b"])
    assert f.shape == (64,) and f[0] == 1.0 and f[-1] == pytest.approx(8.0)
    assert np.all(np.diff(f) >= 0)


def test_streamed_f16_file_loads_and_runs(tmp_path):
    path = tmp_path / "tiny.gguf"
    shapes.write_f16(TINY, path, seed=3)
    with GGUFReader(path) as r:
        assert r.kv["llama.block_count"] == 2 and len(r.kv["tokenizer.ggml.tokens"]) == TINY.n_vocab
        t = r.tensors
        assert len(t) == 1 + 1 + 9 * TINY.n_layer + 2
        assert t["blk.1.ffn_down.weight"].ne == (160, 64) and t["blk.1.ffn_down.weight"].type == GGMLType.F16
        down = t["blk.1.ffn_down.weight"].data.view(np.float16).astype(np.float32)
        assert down.std() == pytest.approx(1 / np.sqrt(160), rel=0.05)
        norm = t["blk.0.attn_norm.weight"]         # 1-D tensors in F32: llama.cpp's CPU mul needs it
        assert norm.type == GGMLType.F32 and np.all(norm.data.view(np.float32) == 1)
        first = t["token_embd.weight"].data.copy()
    shapes.write_f16(TINY, tmp_path / "again.gguf", seed=3)
    assert (tmp_path / "again.gguf").read_bytes() == path.read_bytes()          # seeded
    shapes.write_f16(TINY, tmp_path / "other.gguf", seed=4)
    with GGUFReader(tmp_path / "other.gguf") as r:
        assert not np.array_equal(r.tensors["token_embd.weight"].data, first)
    ctx = llm.Context(llm.load_model(path), n_ctx=32, n_ubatch=32)
    toks = np.asarray(ctx.model.vocab.tokenize("hello world, twice"), np.int32)
    assert ctx.decode(llm.Batch(toks)) == 0, ctx.last_error
    logits = ctx.get_logits()
    assert np.all(np.isfinite(logits)) and 0.1 < logits.std() < 10
