"""split_mode="row" (tensor parallelism): argument errors here, on this process's one
device; the multi-device checks in a subprocess with 4 simulated CPU devices
(tests/row_split_check.py): one-device logits within 1e-4 over 2 and 4 devices, ~1/n of
every split matrix's bytes per device, the KV cache divided by KV heads when they divide,
no compiles in steady state, each node's sharding in the scheduler dump, and a clear error
for a shape that cannot be split."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import row_split_check as check
from tiny_model import TinySpec, write_model

import llm
from ggmlx import weights
from ggmlx.types import GGMLType

ROOT = Path(__file__).resolve().parent.parent


def run_check(out: Path, models: list[str]) -> tuple[dict, dict[str, np.ndarray]]:
    env = dict(os.environ, GGMLX_SCHED_DEBUG="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "row_split_check.py"), str(out), *models],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    info = json.loads((out / "result.json").read_text())
    with np.load(out / "result.npz") as z:
        return info, {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return run_check(tmp_path_factory.mktemp("rowsplit"), list(check.SPECS))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinySpec(n_layer=1))


# ---- argument errors (one device) ------------------------------------------------------------

def test_unknown_split_mode(tiny_path):
    with pytest.raises(ValueError, match="split_mode must be one of layer, row"):
        llm.load_model(tiny_path, split_mode="tensor")


def test_tensor_split_with_row_is_an_error(tiny_path):
    with pytest.raises(ValueError, match="tensor_split .* split_mode 'row'"):
        llm.load_model(tiny_path, split_mode="row", tensor_split=[1.0])


def test_row_and_layer_cannot_be_mixed(tiny_path):
    with pytest.raises(ValueError, match="cannot be mixed with a layer split"):
        llm.load_model(tiny_path, split_mode="row", n_gpu_layers=1)


@pytest.mark.slow
def test_row_on_one_device_is_the_plain_model(tiny_path):
    import jax
    ref = llm.Context(llm.load_model(tiny_path, devices=[]), n_ctx=32)
    row = llm.Context(llm.load_model(tiny_path, devices=jax.devices("cpu")[:1], split_mode="row"), n_ctx=32)
    for ctx in (ref, row):
        assert ctx.decode(llm.Batch([1, 7, 9])) == 0
    np.testing.assert_allclose(row.get_logits_ith(-1), ref.get_logits_ith(-1), atol=1e-5)


def test_kv_estimate_on_one_device(tiny_path):
    """kv_bytes_per_device (check_fits' estimate) is what the cache buffers hold, with a
    layer split and with a row split over one device."""
    import jax

    from llm.kv_cache import KV_TYPES, kv_bytes_per_device
    for model in (llm.load_model(tiny_path, devices=[]),
                  llm.load_model(tiny_path, devices=jax.devices("cpu")[:1], split_mode="row")):
        ctx = llm.Context(model, n_ctx=32, type_k="f16")
        held = sum(t.data.nbytes for t in ctx.memory.k_l + ctx.memory.v_l)
        est = kv_bytes_per_device(model, 32, KV_TYPES["f16"], KV_TYPES["f32"])
        assert list(est.values()) == [held]


@pytest.mark.parametrize("split,ne,n,msg", [
    (weights.WeightSplit(1), (64, 30), 4, "30 rows do not split evenly over 4 devices"),
    (weights.WeightSplit(0), (64, 32), 4, "64 columns do not split over 4 devices in whole Q8_0 blocks of 32"),
    (weights.WeightSplit(0), (96, 32), 2, "96 columns do not split over 2 devices in whole Q8_0 blocks"),
])
def test_check_split_names_the_tensor(split, ne, n, msg):
    with pytest.raises(ValueError, match=f"'blk.0.x.weight'.*{msg}"):
        weights.check_split("blk.0.x.weight", GGMLType.Q8_0, ne, n, split)


def test_check_split_accepts_whole_blocks():
    weights.check_split("w", GGMLType.Q8_0, (128, 6), 2, weights.WeightSplit(0))
    weights.check_split("w", GGMLType.Q8_0, (64, 6), 2, weights.WeightSplit(1))


def test_cli_has_split_mode():
    from llm.cli.commands import build_parser
    a = build_parser().parse_args(["generate", "-p", "x", "-sm", "row"])
    assert a.split_mode == "row"
    from llm.cli.commands import _row_plan
    assert _row_plan(a) is None
    a = build_parser().parse_args(["generate", "-p", "x", "-sm", "row", "--row-heads", "pad", "--row-vocab", "cols"])
    assert _row_plan(a) == llm.RowPlan(uneven_heads="pad", vocab="cols")


# ---- simulated devices (subprocess) -----------------------------------------------------------

CASES = [(name, n) for name in check.SPECS for n in (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("name,n", CASES)
def test_row_split_gives_one_device_logits(tiny, name, n):
    _, arrays = tiny
    one, split = arrays[f"{name}/1"], arrays[f"{name}/{n}"]
    assert np.isfinite(one).all() and one.std() > 1.0
    assert np.abs(split - one).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name,n", CASES)
def test_each_device_holds_its_share_of_every_split_matrix(tiny, name, n):
    info, _ = tiny
    splits = info["cases"][f"{name}/{n}"]["splits"]
    spec = check.SPECS[name]
    assert len(splits) == 2 + 7 * spec.n_layer - (1 if spec.arch == "gemma3" else 0)   # tied output
    for tname, s in splits.items():
        per = s["per_device"]
        assert sorted(per) == [str(i) for i in range(n)], tname
        assert all(v == s["total"] // n for v in per.values()), (tname, s)


@pytest.mark.slow
@pytest.mark.parametrize("name,n", CASES)
def test_attention_by_heads_when_they_divide(tiny, name, n):
    """The default plan: attention by heads where they divide; else padded to whole heads
    per device where the model allows it (gemma3's one KV head copied), else gathered (the
    tiny llama's 16-feature heads are not whole Q8_0 blocks of its attn_output)."""
    info, _ = tiny
    case = info["cases"][f"{name}/{n}"]
    spec = check.SPECS[name]
    by_heads = spec.n_head % n == 0 and spec.n_head_kv % n == 0
    assert case["uneven_heads"] == ("gather" if name == "llama" else "pad")
    padded = not by_heads and case["uneven_heads"] == "pad"
    assert case["kv_split"] == (by_heads or padded)
    split = case["splits"]["blk.0.attn_output.weight"]["split"]
    assert split == ("cols+reduce" if by_heads else f"cols+reduce+heads{case['n_head']}" if padded
                     else "rows+gather")
    assert case["splits"]["blk.0.ffn_down.weight"]["split"] == "cols+reduce"
    assert case["splits"]["blk.0.ffn_up.weight"]["split"] == "rows"
    assert case["splits"]["token_embd.weight"]["split"] == "rows+gather"
    kv = case["kv_bytes_per_device"]
    assert len(kv) == n
    total = 2 * spec.n_layer * case["n_head_kv"] * spec.head_dim * 64 * 4
    assert all(v == (total // n if case["kv_split"] else total) for v in kv.values())


@pytest.mark.slow
@pytest.mark.parametrize("name,n", CASES)
def test_steady_state_reuses_compiled_graphs(tiny, name, n):
    case = tiny[0]["cases"][f"{name}/{n}"]
    assert case["step_compiles"][1:] == [0] * (len(case["step_compiles"]) - 1)
    assert case["prefill_again_compiles"] == 0


@pytest.mark.slow
def test_dump_shows_each_nodes_sharding(tiny):
    dump = tiny[0]["cases"]["llama/2"]["dump"]
    assert "## SPLIT #0: TP[CPU0,CPU1]" in dump
    assert "## SPLIT #1" not in dump           # one SPMD program: no copies between devices
    for line in (ln for ln in dump.splitlines() if ln.startswith("node")):
        assert "]{" in line, line              # every node carries a sharding
    assert "blk.0.attn_q.weight[TP[CPU0,CPU1]]{rows}" in dump
    assert "blk.0.attn_output.weight[TP[CPU0,CPU1]]{cols+reduce}" in dump
    assert "cache_k_l0[TP[CPU0,CPU1]]{S(0)}" in dump
    assert "blk.0.attn_norm.weight[TP[CPU0,CPU1]]{R}" in dump       # norms replicated
    # attention by heads: every node's layout is known, the attention runs divided by heads
    dump = tiny[0]["cases"]["llama_mha/4"]["dump"]
    assert "{auto}" not in dump
    assert re.search(r"__fattn__-0 +\[TP\[CPU0,CPU1,CPU2,CPU3\]\]\{S\(1\)\}", dump)     # by heads
    assert re.search(r"kqv_out-0 +\[TP\[CPU0,CPU1,CPU2,CPU3\]\]\{S\(0\)\}", dump)       # heads merged


@pytest.mark.slow
def test_unsplittable_shape_is_a_clear_error(tiny):
    err = tiny[0]["bad_shape_error"]
    assert err is not None
    assert "blk.0.attn_output.weight" in err and "whole Q8_0 blocks" in err and "4 devices" in err


@pytest.mark.slow
@pytest.mark.parametrize("fixture,atol", [
    ("smollm2_path", 1e-4),
    # Gemma3's residual stream is ~25x larger (embeddings scaled by sqrt(n_embd)) and its
    # logits reach ~25: the all-reduced partial sums differ from one device's dot in the
    # last f32 bits, measured up to 4.1e-4 absolute, 1.6e-5 of the largest logit
    ("gemma3_path", 1e-3),
])
def test_real_model_row_split_gives_one_device_logits(request, tmp_path, fixture, atol):
    path = request.getfixturevalue(fixture)
    info, arrays = run_check(tmp_path, [str(path)])
    stem = Path(path).stem
    one = arrays[f"{stem}/1"]
    for n in (2, 4):
        assert np.abs(arrays[f"{stem}/{n}"] - one).max() <= atol, n
        assert (arrays[f"{stem}/{n}"].argmax(-1) == one.argmax(-1)).all(), n
        case = info["cases"][f"{stem}/{n}"]
        assert case["step_compiles"][1:] == [0] * (len(case["step_compiles"]) - 1)
        for tname, s in case["splits"].items():
            assert all(v == s["total"] // n for v in s["per_device"].values()), tname


# ---- RowPlan alternatives and the KV estimate (same subprocess) ----------------------------------

@pytest.mark.parametrize("n_head,n_head_kv,n,kv,q", [
    (8, 4, 2, (0, 1, 2, 3), tuple(range(8))),                        # divide: unchanged
    (4, 1, 2, (0, 0), (0, 1, 2, 3)),                                 # Gemma3-270M: KV head copied
    (4, 1, 4, (0, 0, 0, 0), (0, 1, 2, 3)),
    (9, 3, 2, (0, 1, 2, -1), (0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1)),   # SmolLM2: a zero head group
    (9, 3, 4, (0, 1, 2, -1), (0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1)),
])
def test_head_layout(n_head, n_head_kv, n, kv, q):
    from llm.model import head_layout
    assert head_layout(n_head, n_head_kv, n) == (kv, q)
    # each device's query heads read only its own KV heads (the graph's GQA mapping)
    g = len(q) // len(kv)
    for d in range(n):
        for h in range(d * len(q) // n, (d + 1) * len(q) // n):
            assert h // g in range(d * len(kv) // n, (d + 1) * len(kv) // n)
            assert q[h] == -1 or q[h] // (n_head // n_head_kv) == kv[h // g]


def test_row_plan_rejects_unknown_choices():
    with pytest.raises(ValueError, match="uneven_heads must be 'auto', 'gather' or 'pad'"):
        llm.RowPlan(uneven_heads="zero")
    with pytest.raises(ValueError, match="vocab must be 'rows' or 'cols'"):
        llm.RowPlan(vocab="heads")


PLAN_CASES = [f"{name}/{n}/{heads}/{vocab}" for name, n, heads, vocab in check.PLAN_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("key", PLAN_CASES)
def test_row_plan_gives_one_device_logits(tiny, key):
    info, arrays = tiny
    name, n, heads, vocab = key.split("/")
    one, split = arrays[f"{name}/1"], arrays[key]
    assert np.isfinite(one).all() and one.std() > 1.0
    assert np.abs(split - one).max() <= 1e-4
    case = info["cases"][key]
    assert case["step_compiles"][1:] == [0] * (len(case["step_compiles"]) - 1)
    assert case["prefill_again_compiles"] == 0
    for tname, s in case["splits"].items():
        assert all(v == s["total"] // int(n) for v in s["per_device"].values()), tname
    spec = {**check.SPECS, **check.PLAN_SPECS}[name]
    assert case["splits"]["token_embd.weight"]["split"] == ("cols+reduce" if vocab == "cols" else "rows+gather")
    if heads == "pad":
        # whole heads on every device: the KV cache divided, one all-reduce after attn_output
        assert case["kv_split"]
        assert case["n_head_kv"] % int(n) == 0 and case["n_head"] % int(n) == 0
        assert case["splits"]["blk.0.attn_output.weight"]["split"].startswith("cols+reduce+heads")
        assert case["splits"]["blk.0.attn_q.weight"]["split"].startswith("rows+heads")
        kv = case["kv_bytes_per_device"]
        assert set(kv.values()) == {2 * spec.n_layer * case["n_head_kv"] * spec.head_dim * 64 * 4 // int(n)}
        assert "]{auto}" not in case["dump"]
        devs = ",".join(f"CPU{i}" for i in range(int(n)))                # GGMLX_SCHED_DEBUG shows it
        assert f"blk.0.attn_output.weight[TP[{devs}]]{{cols+reduce+heads{case['n_head']}}}" in case["dump"]


@pytest.mark.slow
def test_padding_needs_heads_of_whole_blocks(tiny):
    err = tiny[0]["pad_error"]
    assert err is not None
    assert "blk.0.attn_output.weight" in err and "heads of 16 features are not whole Q8_0 blocks of 32" in err


@pytest.mark.slow
@pytest.mark.parametrize("key", [f"{name}/{n}" for name, n in CASES] + PLAN_CASES)
def test_kv_estimate_is_per_device(tiny, key):
    """check_fits' estimate (kv_bytes_per_device) is what each device holds: 1/n of the
    cache when it is divided by KV heads, all of it when replicated."""
    case = tiny[0]["cases"][key]
    assert case["kv_estimate_per_device"] == case["kv_bytes_per_device"]
