"""llm.load_model on tiny generated models (tests/tiny_model.py) and the two real models:
loader errors that name what is wrong, the cancellable progress callback, vocab_only, tied
output embeddings and llama.cpp's layer placement (place_layers)."""
from __future__ import annotations

import gc

import jax
import numpy as np
import pytest
from tiny_model import TinySpec, model_kv, model_tensors, write_gguf, write_model

import llm
from ggmlx.types import GGMLType
from llm.model import fuse_weights, place_layers

SPEC = TinySpec(arch="llama", n_layer=2, seed=3)


def write(tmp_path, kv=None, tensors=None, name="m.gguf", **kw):
    return write_gguf(tmp_path / name, model_kv(SPEC) if kv is None else kv,
                      model_tensors(SPEC) if tensors is None else tensors, **kw)


def n_live_arrays() -> int:
    gc.collect()
    return len(jax.live_arrays())


# ---- errors ----------------------------------------------------------------------------

def test_unknown_architecture_is_named(tmp_path):
    kv = {k.replace("llama.", "grok9."): v for k, v in model_kv(SPEC).items()}
    kv["general.architecture"] = "grok9"
    path = write(tmp_path, kv=kv)
    with pytest.raises(llm.ModelLoadError, match="grok9") as e:
        llm.load_model(path)
    assert str(path) in str(e.value)


def test_known_but_unsupported_architecture_is_named(tmp_path):
    kv = {k.replace("llama.", "rwkv6."): v for k, v in model_kv(SPEC).items()}
    kv["general.architecture"] = "rwkv6"
    with pytest.raises(llm.ModelLoadError, match="'rwkv6' is not supported"):
        llm.load_model(write(tmp_path, kv=kv))


def test_missing_tensor_is_named(tmp_path):
    t = model_tensors(SPEC)
    del t["blk.1.ffn_up.weight"]
    with pytest.raises(llm.ModelLoadError, match="missing tensor 'blk.1.ffn_up.weight'"):
        llm.load_model(write(tmp_path, tensors=t))


def test_wrong_shape_is_named(tmp_path):
    t = model_tensors(SPEC)
    t["blk.0.attn_k.weight"] = np.ascontiguousarray(t["blk.0.attn_k.weight"].T)
    with pytest.raises(llm.ModelLoadError, match="'blk.0.attn_k.weight' has wrong shape"):
        llm.load_model(write(tmp_path, tensors=t))


def test_extra_unused_tensor_is_named(tmp_path):
    t = model_tensors(SPEC)
    t["blk.0.attn_extra.weight"] = np.zeros(8, np.float32)
    with pytest.raises(llm.ModelLoadError, match="'blk.0.attn_extra.weight'"):
        llm.load_model(write(tmp_path, tensors=t))


def test_missing_hparam_key_is_named(tmp_path):
    kv = model_kv(SPEC)
    del kv["llama.block_count"]
    with pytest.raises(llm.ModelLoadError, match="llama.block_count"):
        llm.load_model(write(tmp_path, kv=kv))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(llm.ModelLoadError, match="no-such.gguf"):
        llm.load_model(tmp_path / "no-such.gguf")
    path = write(tmp_path)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 3])
    with pytest.raises(llm.ModelLoadError, match="cut.gguf"):
        llm.load_model(tmp_path / "cut.gguf")


def test_errors_leave_no_device_arrays(tmp_path):
    t = model_tensors(SPEC)
    t["blk.1.ffn_down.weight"] = t["blk.1.ffn_down.weight"][:, :-1].copy()
    path = write(tmp_path, tensors=t)
    before = n_live_arrays()
    with pytest.raises(llm.ModelLoadError, match="blk.1.ffn_down.weight"):
        llm.load_model(path)
    assert n_live_arrays() == before


# ---- progress and cancellation ---------------------------------------------------------

def test_progress_callback_sees_fractions_up_to_one(tmp_path):
    seen = []
    model = llm.load_model(write(tmp_path), progress_callback=lambda f: seen.append(f) or True, fuse=False)
    assert seen[0] == 0.0 and seen[-1] == 1.0
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) == len(model.weight_tensors()) + 1
    assert all(t.data is not None for t in model.weight_tensors())


@pytest.mark.parametrize("stop_at", [0, 7, "end"])
@pytest.mark.slow
def test_cancel_raises_and_frees_weights(tmp_path, stop_at):
    path = write(tmp_path)
    calls = []

    def progress(frac: float) -> bool:
        calls.append(frac)
        return not (frac == 1.0 if stop_at == "end" else len(calls) > stop_at)

    before = n_live_arrays()
    with pytest.raises(llm.LoadCancelled, match="cancelled"):
        llm.load_model(path, progress_callback=progress)
    assert n_live_arrays() == before
    assert isinstance(llm.LoadCancelled("x"), llm.ModelLoadError)


def test_vocab_only_loads_no_weights(tmp_path):
    before = n_live_arrays()
    model = llm.load_model(write(tmp_path), vocab_only=True)
    assert n_live_arrays() == before
    assert model.tok_embd is None and model.output is None and model.layers == []
    assert model.placement is None and model.weight_tensors() == []
    assert model.vocab.n_tokens == 512 and model.vocab.bos == 1
    assert model.hparams.n_layer == 2


# ---- what gets loaded ------------------------------------------------------------------

def test_tied_output_reuses_token_embd(tmp_path):
    t = model_tensors(SPEC)
    del t["output.weight"]
    model = llm.load_model(write(tmp_path, tensors=t))
    assert model.output is model.tok_embd


def test_quantized_weights_keep_their_type(tmp_path):
    path = write_model(tmp_path / "q.gguf", TinySpec(n_layer=2, wtype="Q8_0"))
    model = llm.load_model(path, fuse=False)
    assert model.layers[0].wq.type == GGMLType.Q8_0
    assert model.layers[0].attn_norm.type == GGMLType.F32
    assert model.n_bytes > 0
    fused = llm.load_model(path, fuse=True)   # wq/wk/wv share one array, as do gate/up; types are kept
    wq, wk, wv = (fused.layers[0].wq, fused.layers[0].wk, fused.layers[0].wv)
    assert wq.type == GGMLType.Q8_0 and wq.ne == model.layers[0].wq.ne and fused.layers[0].wqkv is None
    assert wq.data.array is wk.data.array is wv.data.array
    assert [m.data.spec.rows[1] for m in (wq, wk, wv)] == [0, wq.ne[1], wq.ne[1] + wk.ne[1]]
    assert fused.layers[0].ffn_gate.data.array is fused.layers[0].ffn_up.data.array
    assert sum(t.data.nbytes for t in fused.weight_tensors()) == sum(t.data.nbytes for t in model.weight_tensors())
    # fuse_weights tells each member once its group's copy is made (the loader drops its file pages)
    told: list[str] = []
    assert fuse_weights(model, release=lambda t: told.append(t.name)) == 4
    members = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    assert told == [f"blk.{il}.{n}.weight" for il in range(2) for n in members]
    assert model.layers[1].wq.data.array is model.layers[1].wv.data.array


def test_real_models_load(smollm2_path, gemma3_path):
    smol = llm.load_model(smollm2_path, vocab_only=True)
    assert smol.arch == "llama" and smol.hparams.n_layer == 30 and smol.vocab.n_tokens == 49152
    gemma = llm.load_model(gemma3_path, vocab_only=True)
    assert gemma.arch == "gemma3" and gemma.hparams.n_layer == 18
    assert gemma.hparams.swa_layers == [il % 6 != 5 for il in range(18)]
    assert gemma.hparams.n_swa == 512 and gemma.vocab.n_tokens == 262144


# ---- placement -------------------------------------------------------------------------

DEVS = ["d0", "d1", "d2", "d3"]     # place_layers only picks from the list: any objects do


@pytest.mark.parametrize("n_gpu_layers, tensor_split, layers, output", [
    # -1: all 7 slots (6 layers + output); slot il goes to splits.upper_bound(il / 7)
    (-1, None, ["d0", "d0", "d1", "d1", "d2", "d2"], "d3"),
    (7, None, ["d0", "d0", "d1", "d1", "d2", "d2"], "d3"),
    (99, None, ["d0", "d0", "d1", "d1", "d2", "d2"], "d3"),
    # the last 4 slots: layers 3-5 and the output, 1/4 each
    (4, None, ["cpu", "cpu", "cpu", "d0", "d1", "d2"], "d3"),
    (1, None, ["cpu"] * 6, "d0"),
    (0, None, ["cpu"] * 6, "cpu"),
    # cumulative shares 0.5, 0.67, 0.67, 1: a device with share 0 gets nothing
    (-1, [3, 1, 0, 2], ["d0", "d0", "d0", "d0", "d1", "d3"], "d3"),
    (-1, [1, 1, 0, 0], ["d0", "d0", "d0", "d0", "d1", "d1"], "d1"),
])
def test_place_layers_like_llama_cpp(n_gpu_layers, tensor_split, layers, output):
    cpu = jax.devices("cpu")[0]
    p = place_layers(6, DEVS, n_gpu_layers, tensor_split)
    name = {cpu: "cpu", **{d: d for d in DEVS}}
    assert p.dev_input == cpu
    assert [name[d] for d in p.dev_layer] == layers
    assert name[p.dev_output] == output


def test_place_layers_without_devices_uses_the_cpu():
    cpu = jax.devices("cpu")[0]
    p = place_layers(3, [], -1, None)
    assert p.dev_layer == [cpu] * 3 and p.dev_output == cpu and p.dev_input == cpu


@pytest.mark.parametrize("tensor_split", [[1, 1], [1, -1, 1, 1], [0, 0, 0, 0]])
def test_place_layers_rejects_bad_tensor_split(tensor_split):
    with pytest.raises(ValueError, match="tensor_split"):
        place_layers(6, DEVS, -1, tensor_split)
