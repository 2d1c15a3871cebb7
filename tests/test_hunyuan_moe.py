"""Hunyuan-MoE (issue 29) on the fixture of benchmarks/reference/make_fixture.py (2 layers, 4
experts of feed_forward_length beside a 96-wide shared expert); its logits against llama.cpp
are in test_arch_fixtures, here the sizes it reads and the refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llm
from ggmlx import gguf

FIXTURE = Path(__file__).resolve().parent / "data" / "fixtures" / "hunyuan-moe-F32.gguf"


def test_expert_sizes():
    m = llm.load_model(FIXTURE)
    hp = m.hparams
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (4, 2, 128, 96)
    assert m.layers[0].ffn_up_exps.ne[:3] == (64, 128, 4) and m.layers[0].ffn_up_shexp.ne[:2] == (64, 96)


def rewrite(dst: Path, *, drop_key: str | None = None, kv: dict | None = None) -> Path:
    with gguf.GGUFReader(FIXTURE) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            if k == drop_key:
                continue
            w.add_kv(k, kv[k]) if kv and k in kv else w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            w.add_tensor(name, np.array(ti.data), ti.type, ti.ne)
    w.write(dst)
    return dst


@pytest.mark.parametrize("change,match", [
    (dict(drop_key="hunyuan-moe.expert_feed_forward_length"), r"hunyuan-moe\.expert_feed_forward_length"),
    (dict(kv={"hunyuan-moe.rope.dimension_count": 8}), r"hunyuan-moe\.rope\.dimension_count.*= 8"),
    (dict(kv={"hunyuan-moe.expert_shared_feed_forward_length": 64}), r"blk\.0\.ffn_gate_shexp\.weight.*shape"),
])
def test_bad_metadata_names_the_key(tmp_path, change, match):
    with pytest.raises(llm.ModelLoadError, match=match):
        llm.load_model(rewrite(tmp_path / "bad.gguf", **change))
