"""Tiny llama / gemma3 GGUF models for the llm core tests, and their multi-device check.

Imported, it writes small random-weight models with `ggmlx.gguf.GGUFWriter` (a few KB to a
few hundred KB; compiling their graphs takes about a second), with the SPM vocabulary of the
committed synthetic llama.cpp model (512 tokens), so `llm.load_model` loads them like any
model. `model_kv` / `model_tensors` return the pieces so loader tests can break them.

Run as a script (`python tests/tiny_model.py OUT_DIR`), it first makes JAX see 4 CPU
devices (before any other JAX use), loads a tiny model on one device and split over the 4
devices in several ways, decodes the same tokens with each and writes the logits and the
placements to OUT_DIR/result.npz and OUT_DIR/result.json; tests/test_multidevice_model.py
asserts on them.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

VOCAB_MODEL = Path(__file__).parent / "data" / "synthetic" / "synth-llama-Q4_0.gguf"
N_VOCAB = 512
N_DEVICES = 4


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. gemma3: every 6th layer global, the others sliding-window."""
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_swa: int = 4
    n_ctx_train: int = 512
    seed: int = 0
    wtype: str = "F32"          # type of the 2-D weight matrices: F32, F16 or Q8_0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def vocab_kv() -> list[tuple[str, object, object, object]]:
    """(key, value, type, array type) of every tokenizer.ggml.* key of the committed model."""
    from ggmlx import gguf
    with gguf.GGUFReader(VOCAB_MODEL) as f:
        return [(k, v, f.kv_types[k], f.kv_array_types.get(k))
                for k, v in f.kv.items() if k.startswith("tokenizer.ggml.")]


def model_kv(spec: TinySpec) -> dict[str, object]:
    """The architecture and hyperparameter keys (no tokenizer keys)."""
    a = spec.arch
    kv: dict[str, object] = {
        "general.architecture": a,
        "general.name": f"tiny test model (seed {spec.seed})",
        f"{a}.context_length": spec.n_ctx_train,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.block_count": spec.n_layer,
        f"{a}.feed_forward_length": spec.n_ff,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": spec.n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5 if a == "llama" else 1e-6,
    }
    if a == "llama":
        kv[f"{a}.rope.freq_base"] = 10000.0
        kv[f"{a}.rope.dimension_count"] = spec.head_dim
        kv[f"{a}.vocab_size"] = N_VOCAB
    else:
        kv[f"{a}.rope.freq_base"] = 1000000.0
        kv[f"{a}.attention.key_length"] = spec.head_dim
        kv[f"{a}.attention.value_length"] = spec.head_dim
        kv[f"{a}.attention.sliding_window"] = spec.n_swa
    return kv


def model_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """Seeded float32 weights in numpy order (ne reversed): matrices ~ N(0, 1/fan_in), norms
    ~ 1 + N(0, 0.1); embeddings and output scaled so the logits spread (std ~2-3)."""
    rng = np.random.default_rng(spec.seed)
    d, e, f = spec.head_dim, spec.n_embd, spec.n_ff

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int, center: float = 1.0) -> np.ndarray:
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)

    gemma = spec.arch == "gemma3"
    t: dict[str, np.ndarray] = {}
    # gemma3 scales the input by sqrt(n_embd) and ties the output to the embedding
    t["token_embd.weight"] = (rng.standard_normal((N_VOCAB, e)) * (0.05 if gemma else 1.0)).astype(np.float32)
    t["output_norm.weight"] = norm(e, center=8.0 if gemma else 1.0)
    if not gemma:
        t["output.weight"] = mat(N_VOCAB, e, gain=3.0)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = norm(e)
        t[p + "attn_q.weight"] = mat(spec.n_head * d, e)
        t[p + "attn_k.weight"] = mat(spec.n_head_kv * d, e)
        t[p + "attn_v.weight"] = mat(spec.n_head_kv * d, e)
        t[p + "attn_output.weight"] = mat(e, spec.n_head * d)
        t[p + "ffn_norm.weight"] = norm(e)
        t[p + "ffn_gate.weight"] = mat(f, e)
        t[p + "ffn_up.weight"] = mat(f, e)
        t[p + "ffn_down.weight"] = mat(e, f)
        if gemma:
            t[p + "attn_q_norm.weight"] = norm(d)
            t[p + "attn_k_norm.weight"] = norm(d)
            t[p + "post_attention_norm.weight"] = norm(e)
            t[p + "post_ffw_norm.weight"] = norm(e)
    return t


def write_gguf(path: Path, kv: dict[str, object], tensors: dict[str, np.ndarray],
               wtype: str = "F32", with_vocab: bool = True) -> Path:
    """Write kv + (optionally) the tokenizer keys + tensors; 2-D matrices in `wtype`."""
    from ggmlx import gguf, quants
    from ggmlx.types import GGMLType
    w = gguf.GGUFWriter()
    for k, v in kv.items():
        w.add_kv(k, v)
    if with_vocab:
        for k, v, vtype, atype in vocab_kv():
            w.add_kv(k, v, vtype, atype)
    for name, x in tensors.items():
        if x.ndim != 2 or wtype == "F32":
            w.add_tensor(name, x)
        elif wtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            t = GGMLType[wtype]
            w.add_tensor(name, quants.quantize(x, t), t, tuple(reversed(x.shape)))
    w.write(path)
    return Path(path)


def write_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    return write_gguf(path, model_kv(spec), model_tensors(spec), spec.wtype)


def prompt_tokens(n: int, seed: int = 1) -> list[int]:
    """n token ids: BOS, then random ids among the non-special tokens."""
    rng = np.random.default_rng(seed)
    return [1] + [int(x) for x in rng.integers(3, N_VOCAB, n - 1)]


# ---- the multi-device check (script mode) ------------------------------------------------

N_PROMPT = 20
N_GEN = 4
CONFIGS = {
    # name: load_model arguments (devices are filled in)
    "one_device": dict(),
    "even_4": dict(n_gpu_layers=-1),
    "uneven_4": dict(n_gpu_layers=-1, tensor_split=[3.0, 1.0, 0.0, 2.0]),
    "partial_offload": dict(n_gpu_layers=4),
}
SPECS = {
    "llama": TinySpec(arch="llama", n_layer=6, seed=11, wtype="Q8_0"),
    "gemma3": TinySpec(arch="gemma3", n_layer=6, n_head_kv=1, seed=12),
}


def _decode_all(model) -> np.ndarray:
    """Logits of every prompt position, then of N_GEN single-token steps [N_PROMPT + N_GEN, V]."""
    import llm
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32, kv_bucket=64)
    toks = prompt_tokens(N_PROMPT)
    assert ctx.decode(llm.Batch(toks, logits=np.ones(N_PROMPT, bool))) == 0, ctx.last_error
    rows = [ctx.get_logits().copy()]
    for k in range(N_GEN):
        assert ctx.decode(llm.Batch.get_one([5 + k])) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1)[None].copy())
    return np.concatenate(rows)


def run_multidevice(out_dir: Path) -> None:
    import jax

    import ggmlx
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    import llm

    devices = jax.devices("cpu")
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, object] = {"n_devices": len(devices), "placement": {}, "weight_devices": {}}
    for arch, spec in SPECS.items():
        path = write_model(out_dir / f"tiny-{arch}.gguf", spec)
        for name, cfg in CONFIGS.items():
            if name == "one_device":
                model = llm.load_model(path, devices=[])
            else:
                model = llm.load_model(path, devices=devices, **cfg)
            pl = model.placement
            info["placement"][f"{arch}/{name}"] = {
                "input": pl.dev_input.id, "layers": [d.id for d in pl.dev_layer], "output": pl.dev_output.id}
            info["weight_devices"][f"{arch}/{name}"] = sorted(
                {(t.name, next(iter(t.data.array.devices())).id) for t in model.weight_tensors()})
            arrays[f"{arch}/{name}"] = _decode_all(model)
    np.savez(out_dir / "result.npz", **arrays)
    (out_dir / "result.json").write_text(json.dumps(info))


if __name__ == "__main__":
    run_multidevice(Path(sys.argv[1]))
