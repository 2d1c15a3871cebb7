"""Tiny random-weight fixtures per architecture, with llama.cpp's outputs as the oracle.

    python benchmarks/reference/make_fixture.py ARCH [ARCH ...]     # or: all
    python benchmarks/reference/make_fixture.py --tokenizers        # WPM / UGM / Gemma 4 tokenizer data
    python benchmarks/reference/make_fixture.py --synthetic         # the existing synthetic models

For each architecture it writes, under tests/data/fixtures/:

- `<arch>-F32.gguf`: a few layers, small dimensions, every tensor and hparam key llama.cpp's
  loader requires for that architecture, seeded random weights (matrices ~ N(0, 1/fan_in),
  norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)) and a tokenizer section (the 512-token SPM
  vocabulary of the synthetic models; a synthetic WordPiece vocabulary for BERT-style
  encoders);
- `<arch>-<QTYPE>.gguf`: the same weights with every weight matrix quantized (ggmlx's
  quantizers, which are bit-exact with ggml's);
- `<arch>.npz`: llama.cpp run on them through llama-cpp-python (CPU, flash attention off,
  F32 KV cache, one ubatch): for each token sequence k, `tokens_k`, all-position logits of
  the F32 model `logits_k` [T, n_vocab], of the quantized model's dequantized-F32 twin
  `twin_logits_k` and the argmax of llama.cpp's own quantized run `q_top1_k` (activations
  quantized in its matmuls); embeddings `embd_none_k` [T, n_embd] (per token) and
  `embd_<pooling>_k` [n_embd] for the pooling types the model can give (mean, cls, last;
  rank [n_cls_out] for a classifier head).

`--tokenizers` writes `tokenizer-<wpm|ugm|gemma4>.gguf` (vocabulary only) and
`tokenizer-<wpm|ugm|gemma4>.jsonl.gz` with llama.cpp's `tokenize` ids (4 flag combinations) and
`detokenize` text for the corpus of tests/data/tokenizer. `--synthetic` writes
`tests/data/synthetic/<stem>.llamacpp.npz` for the committed synthetic models, the same
arrays by the same runner, so every architecture has one path.

Everything is seeded: rerunning reproduces the stored files byte for byte (the GGUFs) and
number for number (llama.cpp on the same CPU). The parity tests read only the stored files,
so CI needs no llama-cpp-python; this script does (`pip install -e .[compare]`).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gzip
import json
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "data" / "fixtures"
SPM_VOCAB_MODEL = ROOT / "tests" / "data" / "synthetic" / "synth-llama-Q4_0.gguf"
CORPUS = ROOT / "tests" / "data" / "tokenizer" / "smollm2-135m-instruct-q4_1.tokenize.jsonl.gz"
N_VOCAB = 512
SEQ_LENS = (16, 9, 5)
N_CTX = 64


@dataclasses.dataclass(frozen=True)
class Dims:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 128
    n_expert: int = 4
    n_expert_used: int = 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Weights:
    """Seeded tensors in numpy order (ne reversed), added in declaration order."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.t: dict[str, np.ndarray] = {}
        self.fixed: dict[str, str] = {}     # tensors stored in this ggml type in every file

    def mat(self, name: str, n_out: int, n_in: int, gain: float = 1.0, n_exp: int = 0) -> None:
        shape = (n_exp, n_out, n_in) if n_exp else (n_out, n_in)
        self.t[name] = (self.rng.standard_normal(shape) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm(self, name: str, n: int, center: float = 1.0) -> None:
        self.t[name] = (center + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self.t[name] = (scale * self.rng.standard_normal(shape)).astype(np.float32)

    def embd(self, name: str, n_rows: int, n_embd: int, scale: float = 1.0) -> None:
        self.t[name] = (scale * self.rng.standard_normal((n_rows, n_embd))).astype(np.float32)


def base_kv(arch: str, d: Dims, *, rms: bool = True, rope: bool = True) -> dict[str, object]:
    kv: dict[str, object] = {
        "general.architecture": arch,
        # no architecture name here: llama.cpp keys tokenizer special cases off general.name
        "general.name": "fixture model",
        f"{arch}.context_length": d.n_ctx_train,
        f"{arch}.embedding_length": d.n_embd,
        f"{arch}.block_count": d.n_layer,
        f"{arch}.feed_forward_length": d.n_ff,
        f"{arch}.attention.head_count": d.n_head,
        f"{arch}.attention.head_count_kv": d.n_head_kv,
    }
    if rms:
        kv[f"{arch}.attention.layer_norm_rms_epsilon"] = 1e-5
    else:
        kv[f"{arch}.attention.layer_norm_epsilon"] = 1e-5
    if rope:
        kv[f"{arch}.rope.freq_base"] = 10000.0
        kv[f"{arch}.rope.dimension_count"] = d.head_dim
    return kv


def attn_qkv(w: Weights, p: str, d: Dims, *, bias: bool = False, n_q: int | None = None) -> None:
    n_q = n_q or d.n_embd
    n_kv = d.n_head_kv * d.head_dim
    w.mat(p + "attn_q.weight", n_q, d.n_embd)
    w.mat(p + "attn_k.weight", n_kv, d.n_embd)
    w.mat(p + "attn_v.weight", n_kv, d.n_embd)
    if bias:
        w.bias(p + "attn_q.bias", n_q)
        w.bias(p + "attn_k.bias", n_kv)
        w.bias(p + "attn_v.bias", n_kv)


def llama_block(w: Weights, p: str, d: Dims) -> None:
    """The tensors of a llama-style layer: RMS norms, q/k/v/o, gated FFN (in a fixed order, so
    the seeded weights stay the same)."""
    w.norm(p + "attn_norm.weight", d.n_embd)
    attn_qkv(w, p, d)
    w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
    w.norm(p + "ffn_norm.weight", d.n_embd)
    w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
    w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
    w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)


def output(w: Weights, d: Dims, *, norm_bias: bool = False, tied: bool = False, out_bias: bool = False) -> None:
    w.norm("output_norm.weight", d.n_embd)
    if norm_bias:
        w.bias("output_norm.bias", d.n_embd)
    if not tied:
        w.mat("output.weight", N_VOCAB, d.n_embd, gain=3.0)
    if out_bias:
        w.bias("output.bias", N_VOCAB)


def moe(w: Weights, p: str, d: Dims, n_ff_exp: int, *, router_gain: float = 4.0) -> None:
    w.mat(p + "ffn_gate_inp.weight", d.n_expert, d.n_embd, gain=router_gain)
    w.mat(p + "ffn_gate_exps.weight", n_ff_exp, d.n_embd, n_exp=d.n_expert)
    w.mat(p + "ffn_down_exps.weight", d.n_embd, n_ff_exp, n_exp=d.n_expert)
    w.mat(p + "ffn_up_exps.weight", n_ff_exp, d.n_embd, n_exp=d.n_expert)


# ---- architectures ---------------------------------------------------------------------------


def spec_qwen3moe(d: Dims, w: Weights) -> dict:
    a = "qwen3moe"
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.attention.key_length"] = d.head_dim
    kv[f"{a}.attention.value_length"] = d.head_dim
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, 32)
    return kv


def spec_qwen2moe(d: Dims, w: Weights) -> dict:
    a = "qwen2moe"
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    kv[f"{a}.expert_shared_feed_forward_length"] = 64
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, 32)
        w.bias(p + "ffn_gate_inp_shexp.weight", d.n_embd, scale=1.0 / np.sqrt(d.n_embd))
        w.mat(p + "ffn_gate_shexp.weight", 64, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 64)
        w.mat(p + "ffn_up_shexp.weight", 64, d.n_embd)
    return kv


def spec_olmo2(d: Dims, w: Weights) -> dict:
    kv = base_kv("olmo2", d)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.n_head_kv * d.head_dim)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.norm(p + "post_ffw_norm.weight", d.n_embd)
    return kv


def spec_granite(d: Dims, w: Weights) -> dict:
    a = "granite"
    kv = base_kv(a, d)
    kv[f"{a}.logit_scale"] = 0.5
    kv[f"{a}.residual_scale"] = 0.7
    kv[f"{a}.embedding_scale"] = 3.0
    kv[f"{a}.attention.scale"] = 0.2
    kv[f"{a}.vocab_size"] = N_VOCAB
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=0.3)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        llama_block(w, p, d)
    return kv


def spec_granitemoe(d: Dims, w: Weights) -> dict:
    a = "granitemoe"
    kv = base_kv(a, d)
    kv[f"{a}.logit_scale"] = 0.5
    kv[f"{a}.residual_scale"] = 0.7
    kv[f"{a}.embedding_scale"] = 3.0
    kv[f"{a}.attention.scale"] = 0.2
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_shared_feed_forward_length"] = 64
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=0.3)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, d.n_ff)
        w.mat(p + "ffn_gate_shexp.weight", 64, d.n_embd)
        w.mat(p + "ffn_up_shexp.weight", 64, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 64)
    return kv


def parallel_block(w: Weights, p: str, d: Dims) -> None:
    """Command-R's layer: one LayerNorm (no bias) before both attention and the gated FFN."""
    w.norm(p + "attn_norm.weight", d.n_embd)
    attn_qkv(w, p, d)
    w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
    w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
    w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
    w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)


def spec_command_r(d: Dims, w: Weights) -> dict:
    a = "command-r"
    kv = base_kv(a, d, rms=False)
    kv[f"{a}.logit_scale"] = 0.25
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=2.0)      # also the output head (tied)
    w.norm("output_norm.weight", d.n_embd)
    for il in range(d.n_layer):
        parallel_block(w, f"blk.{il}.", d)
    return kv


def spec_cohere2(d: Dims, w: Weights) -> dict:
    d = dataclasses.replace(d, n_layer=4)      # layers 0-2 slide (window 4), layer 3 is global without rope
    a = "cohere2"
    kv = base_kv(a, d, rms=False)
    kv[f"{a}.logit_scale"] = 0.25
    kv[f"{a}.attention.sliding_window"] = 4
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=2.0)
    w.norm("output_norm.weight", d.n_embd)
    for il in range(d.n_layer):
        parallel_block(w, f"blk.{il}.", d)
    return kv


def spec_glm4(d: Dims, w: Weights) -> dict:
    a = "glm4"
    kv = base_kv(a, d)
    kv[f"{a}.rope.dimension_count"] = d.head_dim // 2       # partial rotary, as GLM-4's 0.5
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", 2 * d.n_ff, d.n_embd)           # [gate; up]
        w.norm(p + "post_ffw_norm.weight", d.n_embd)
    return kv


def spec_ernie4_5(d: Dims, w: Weights) -> dict:
    kv = base_kv("ernie4_5", d)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        llama_block(w, f"blk.{il}.", d)
    return kv


def spec_ernie4_5_moe(d: Dims, w: Weights) -> dict:
    """One dense layer, then a softmax MoE with a selection bias and a shared expert."""
    a = "ernie4_5-moe"
    kv = base_kv(a, d)
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    kv[f"{a}.expert_shared_feed_forward_length"] = 48
    kv[f"{a}.interleave_moe_layer_step"] = 1
    kv[f"{a}.leading_dense_block_count"] = 1
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        if il == 0:
            llama_block(w, p, d)
            continue
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, 32)
        w.bias(p + "exp_probs_b.bias", d.n_expert, scale=0.5)
        w.mat(p + "ffn_gate_shexp.weight", 48, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 48)
        w.mat(p + "ffn_up_shexp.weight", 48, d.n_embd)
    return kv


def spec_seed_oss(d: Dims, w: Weights) -> dict:
    kv = base_kv("seed_oss", d)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
    return kv


def spec_apertus(d: Dims, w: Weights) -> dict:
    """Apertus: per-head Q/K RMS norms, NEOX rope and an ungated up -> xIELU -> down FFN whose
    constants differ per layer (the file's raw alphas; ggml constrains them with softplus)."""
    kv = base_kv("apertus", d)
    kv.update({"xielu.alpha_n": [0.8, 0.6], "xielu.alpha_p": [0.8, 1.1], "xielu.beta": [0.5, 0.4],
               "xielu.eps": [-1e-6, -1e-6]})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
    return kv


def spec_qwen2vl(d: Dims, w: Weights) -> dict:
    """Qwen2-VL's text tower: M-RoPE over sections of t/h/w pairs (head 16: 8 pairs)."""
    a = "qwen2vl"
    kv = base_kv(a, d)
    kv[f"{a}.rope.dimension_sections"] = [3, 3, 2, 0]
    kv[f"{a}.attention.layer_norm_rms_epsilon"] = 1e-12       # llama.cpp 0.3.36 normalizes with 0 here
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def spec_qwen3vl(d: Dims, w: Weights) -> dict:
    """Qwen3-VL's text tower: IMROPE (head 16: 8 pairs, sections 3/3/1: pair 5 takes the e
    stream, unrotated for text) and two DeepStack layers (text adds nothing)."""
    a = "qwen3vl"
    kv = base_kv(a, d)
    kv[f"{a}.rope.dimension_sections"] = [3, 3, 1, 0]
    kv[f"{a}.n_deepstack_layers"] = 2
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def delta_net_block(w: Weights, p: str, d: Dims, *, d_state: int, n_k_heads: int, n_v_heads: int,
                    fused: bool = False) -> None:
    """A Gated DeltaNet layer's tensors: q, k, v (attn_qkv) and z (attn_gate), or qwen3next's
    fused per-key-head [q, k, v, z] (ssm_in) and [beta, alpha] (ssm_ba); the conv, the dt bias,
    A = -exp(.) per value head, the head-wide output norm and the output projection."""
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    if fused:
        w.mat(p + "ssm_in.weight", 2 * key_dim + 2 * value_dim, d.n_embd)
        w.mat(p + "ssm_ba.weight", 2 * n_v_heads, d.n_embd, gain=2.0)
    else:
        w.mat(p + "attn_qkv.weight", conv_dim, d.n_embd)
        w.mat(p + "attn_gate.weight", value_dim, d.n_embd)
        w.mat(p + "ssm_beta.weight", n_v_heads, d.n_embd, gain=2.0)
        w.mat(p + "ssm_alpha.weight", n_v_heads, d.n_embd, gain=2.0)
    w.mat(p + "ssm_conv1d.weight", conv_dim, 4)
    w.bias(p + "ssm_dt.bias", n_v_heads, scale=0.5)
    w.t[p + "ssm_a"] = -np.exp(0.5 * w.rng.standard_normal(n_v_heads)).astype(np.float32)
    w.norm(p + "ssm_norm.weight", d_state)
    w.mat(p + "ssm_out.weight", d.n_embd, value_dim)


def gated_attn_block(w: Weights, p: str, d: Dims) -> None:
    """Full attention with the output gate in the query projection ([q; gate] per head) and
    Q/K norms."""
    attn_qkv(w, p, d, n_q=2 * d.n_embd)
    w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
    w.norm(p + "attn_q_norm.weight", d.head_dim)
    w.norm(p + "attn_k_norm.weight", d.head_dim)


def delta_net_kv(a: str, d: Dims, *, d_state: int, n_k_heads: int, n_v_heads: int) -> dict:
    kv = base_kv(a, d)
    kv.update({f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.inner_size": d_state * n_v_heads,
               f"{a}.ssm.state_size": d_state, f"{a}.ssm.time_step_rank": n_v_heads,
               f"{a}.ssm.group_count": n_k_heads, f"{a}.full_attention_interval": 4})
    return kv


def spec_qwen35(d: Dims, w: Weights) -> dict:
    """Qwen3.5: 4 layers, three Gated DeltaNet (2 key heads over 4 value heads of 16) then one
    gated full attention; IMROPE over half of each head (4 pairs: sections 2/1/1, as the
    released models rotate a quarter of theirs)."""
    a = "qwen35"
    d = dataclasses.replace(d, n_layer=4)
    kv = delta_net_kv(a, d, d_state=16, n_k_heads=2, n_v_heads=4)
    kv[f"{a}.rope.dimension_count"] = d.head_dim // 2
    kv[f"{a}.rope.dimension_sections"] = [2, 1, 1, 0]
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        if il % 4 == 3:
            gated_attn_block(w, p, d)
        else:
            delta_net_block(w, p, d, d_state=16, n_k_heads=2, n_v_heads=4)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def spec_qwen35moe(d: Dims, w: Weights) -> dict:
    """Qwen3.5 MoE: spec_qwen35's trunk with 4 experts of 32 (top 2) and a gated shared
    expert of 64 in every layer. (Seed 150: 148 put the 2nd and 3rd experts' probabilities
    within 1e-5 of each other at one position, a tie that rounding decides.)"""
    a = "qwen35moe"
    d = dataclasses.replace(d, n_layer=4)
    kv = delta_net_kv(a, d, d_state=16, n_k_heads=2, n_v_heads=4)
    kv[f"{a}.rope.dimension_count"] = d.head_dim // 2
    kv[f"{a}.rope.dimension_sections"] = [2, 1, 1, 0]
    kv.update({f"{a}.expert_count": d.n_expert, f"{a}.expert_used_count": d.n_expert_used,
               f"{a}.expert_feed_forward_length": 32, f"{a}.expert_shared_feed_forward_length": 64})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        if il % 4 == 3:
            gated_attn_block(w, p, d)
        else:
            delta_net_block(w, p, d, d_state=16, n_k_heads=2, n_v_heads=4)
        moe(w, p, d, 32)
        w.t[p + "ffn_gate_inp_shexp.weight"] = (w.rng.standard_normal(d.n_embd) / np.sqrt(d.n_embd)).astype(np.float32)
        w.mat(p + "ffn_gate_shexp.weight", 64, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 64)
        w.mat(p + "ffn_up_shexp.weight", 64, d.n_embd)
    return kv


def spec_qwen3next(d: Dims, w: Weights) -> dict:
    """Qwen3-Next: 4 layers, three Gated DeltaNet with the legacy fused projections (ssm_in
    per key head [q, k, v, z], ssm_ba; 2 key heads each serving 2 of the 4 value heads) then
    one gated full attention (NEOX rope); spec_qwen35moe's experts in every layer."""
    a = "qwen3next"
    d = dataclasses.replace(d, n_layer=4)
    kv = delta_net_kv(a, d, d_state=16, n_k_heads=2, n_v_heads=4)
    kv.update({f"{a}.expert_count": d.n_expert, f"{a}.expert_used_count": d.n_expert_used,
               f"{a}.expert_feed_forward_length": 32, f"{a}.expert_shared_feed_forward_length": 64})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        if il % 4 == 3:
            gated_attn_block(w, p, d)
        else:
            delta_net_block(w, p, d, d_state=16, n_k_heads=2, n_v_heads=4, fused=True)
        moe(w, p, d, 32)
        w.t[p + "ffn_gate_inp_shexp.weight"] = (w.rng.standard_normal(d.n_embd) / np.sqrt(d.n_embd)).astype(np.float32)
        w.mat(p + "ffn_gate_shexp.weight", 64, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 64)
        w.mat(p + "ffn_up_shexp.weight", 64, d.n_embd)
    return kv


def spec_qwen3vlmoe(d: Dims, w: Weights) -> dict:
    """Qwen3-VL-MoE's text tower: qwen3vl's IMROPE sections and DeepStack layers with
    qwen3moe's experts."""
    a = "qwen3vlmoe"
    kv = base_kv(a, d)
    kv[f"{a}.rope.dimension_sections"] = [3, 3, 1, 0]
    kv[f"{a}.n_deepstack_layers"] = 2
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, 32)
    return kv


def spec_gemma3n(d: Dims, w: Weights) -> dict:
    """Gemma 3n: 22 layers, so that the last two attend to the KV cache of layers 18 (SWA)
    and 19 (full) (llama.cpp fixes 20 layers with a cache and every 2nd layer dense here);
    window 4 with its own rope base; AltUp, Laurel and per-layer embeddings at llama.cpp's
    fixed sizes (4 streams, rank 64, 256 per layer), sparsity in layers 0-9. The post-FFN
    and per-layer post norms sit near 0.3 and the AltUp coefficients near 0, so llama.cpp's
    fp16 GELU table (2 GELUs a layer) moves the logits by 4.4e-3, not 4e-2. The per-layer
    token embeddings (5632 x 512) are Q4_0 in every file to keep them small (1.6 MB, not
    5.8 MB in F16; the lookup dequantizes exactly in both engines)."""
    a = "gemma3n"
    d = dataclasses.replace(d, n_layer=22, n_embd=32, n_head=2, n_head_kv=1, n_ff=64)
    n_altup, n_embd_altup, laurel_rank = 4, 256, 64
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.rope.freq_base_swa"] = 10000.0
    kv[f"{a}.attention.sliding_window"] = 4
    kv[f"{a}.attention.sliding_window_pattern"] = 2
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d, tied=True)
    w.mat("altup_proj.weight", d.n_embd, d.n_embd, n_exp=n_altup - 1)
    w.mat("altup_unembd_proj.weight", d.n_embd, d.n_embd, n_exp=n_altup - 1)
    w.embd("per_layer_token_embd.weight", N_VOCAB, n_embd_altup * d.n_layer, scale=0.1)
    w.fixed["per_layer_token_embd.weight"] = "Q4_0"
    w.mat("per_layer_model_proj.weight", n_embd_altup * d.n_layer, d.n_embd)
    w.norm("per_layer_proj_norm.weight", n_embd_altup)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.head_dim, center=0.5)
        w.norm(p + "attn_k_norm.weight", d.head_dim, center=0.5)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.norm(p + "post_ffw_norm.weight", d.n_embd, center=0.3)
        w.mat(p + "inp_gate.weight", n_embd_altup, d.n_embd)
        w.mat(p + "proj.weight", d.n_embd, n_embd_altup)
        w.norm(p + "post_norm.weight", d.n_embd, center=0.3)
        w.mat(p + "altup_correct_coef.weight", n_altup, n_altup, gain=0.1)
        w.norm(p + "altup_correct_scale.weight", d.n_embd)
        w.mat(p + "altup_predict_coef.weight", n_altup * n_altup, n_altup, gain=0.1)
        w.mat(p + "altup_router.weight", n_altup, d.n_embd, gain=float(d.n_embd))
        w.norm(p + "altup_router_norm.weight", d.n_embd)
        w.mat(p + "laurel_l.weight", laurel_rank, d.n_embd)
        w.mat(p + "laurel_r.weight", d.n_embd, laurel_rank)
        w.norm(p + "laurel_post_norm.weight", d.n_embd)
    return kv


def gemma4_layer(w: Weights, p: str, d: Dims, *, n_head_kv: int, head_dim: int, n_ff: int, kv: bool = True,
                 v: bool = True) -> None:
    """One Gemma 4 layer's attention and dense FFN (no K, V or K norm in a layer that reads an
    earlier layer's cache; no V where V comes from K). The post-FFN norm sits near 0.3 so
    that llama.cpp's fp16 GELU table moves the logits by ~1e-3, not ~1e-2."""
    w.norm(p + "attn_norm.weight", d.n_embd)
    w.mat(p + "attn_q.weight", d.n_head * head_dim, d.n_embd)
    if kv:
        w.mat(p + "attn_k.weight", n_head_kv * head_dim, d.n_embd)
        if v:
            w.mat(p + "attn_v.weight", n_head_kv * head_dim, d.n_embd)
        w.norm(p + "attn_k_norm.weight", head_dim, center=0.5)
    w.mat(p + "attn_output.weight", d.n_embd, d.n_head * head_dim)
    w.norm(p + "attn_q_norm.weight", head_dim, center=0.5)
    w.norm(p + "post_attention_norm.weight", d.n_embd)
    w.norm(p + "layer_output_scale.weight", 1, center=0.8)
    w.norm(p + "ffn_norm.weight", d.n_embd)
    w.mat(p + "ffn_gate.weight", n_ff, d.n_embd)
    w.mat(p + "ffn_up.weight", n_ff, d.n_embd)
    w.mat(p + "ffn_down.weight", d.n_embd, n_ff)
    w.norm(p + "post_ffw_norm.weight", d.n_embd, center=0.3)


def gemma4_kv(a: str, d: Dims, swa: list[bool], *, head_full: int, head_swa: int, n_head_kv_full: int) -> dict:
    """Gemma 4's keys: the per-layer SWA pattern, full / SWA head sizes and KV head counts,
    full layers rotating head_full (their rope_freqs leave most of it unrotated), window 4."""
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.rope.freq_base_swa"] = 10000.0
    kv[f"{a}.rope.dimension_count"] = head_full
    kv[f"{a}.rope.dimension_count_swa"] = head_swa
    kv[f"{a}.attention.key_length"] = kv[f"{a}.attention.value_length"] = head_full
    kv[f"{a}.attention.key_length_swa"] = kv[f"{a}.attention.value_length_swa"] = head_swa
    kv[f"{a}.attention.head_count_kv"] = [d.n_head_kv if s else n_head_kv_full for s in swa]
    kv[f"{a}.attention.sliding_window"] = 4
    kv[f"{a}.attention.sliding_window_pattern"] = swa
    kv[f"{a}.attention.layer_norm_rms_epsilon"] = 1e-6
    kv[f"{a}.final_logit_softcapping"] = 30.0
    return kv


def gemma4_rope_freqs(w: Weights, head_full: int) -> None:
    """The proportional rope of the full layers: the first quarter of each head rotates, the
    rest has a frequency factor of 1e30 (no rotation), as the converter writes it."""
    n_rot = head_full // 8
    w.t["rope_freqs.weight"] = np.array([1.0] * n_rot + [1e30] * (head_full // 2 - n_rot), np.float32)


def spec_gemma4(d: Dims, w: Weights) -> dict:
    """Gemma 4 like E2B/E4B: 7 layers (S S F S F S F), full layers with 32-wide heads and one
    KV head, SWA layers 16-wide with two; the last 2 layers share the caches of layers 3 (SWA)
    and 4 (full) and have a double-wide FFN; per-layer embeddings of 32 per layer; tied output."""
    a = "gemma4"
    swa = [True, True, False, True, False, True, False]
    d = dataclasses.replace(d, n_layer=len(swa))
    head_full, head_swa, n_shared, n_pl = 32, 16, 2, 32
    kv = gemma4_kv(a, d, swa, head_full=head_full, head_swa=head_swa, n_head_kv_full=1)
    n_ff = [d.n_ff if il < d.n_layer - n_shared else 2 * d.n_ff for il in range(d.n_layer)]
    kv[f"{a}.feed_forward_length"] = n_ff
    kv[f"{a}.attention.shared_kv_layers"] = n_shared
    kv[f"{a}.embedding_length_per_layer_input"] = n_pl
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d, tied=True)
    gemma4_rope_freqs(w, head_full)
    w.embd("per_layer_token_embd.weight", N_VOCAB, n_pl * d.n_layer, scale=0.1)
    w.mat("per_layer_model_proj.weight", n_pl * d.n_layer, d.n_embd)
    w.norm("per_layer_proj_norm.weight", n_pl)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        head = head_swa if swa[il] else head_full
        gemma4_layer(w, p, d, n_head_kv=d.n_head_kv if swa[il] else 1, head_dim=head, n_ff=n_ff[il],
                     kv=il < d.n_layer - n_shared)
        w.mat(p + "inp_gate.weight", n_pl, d.n_embd)
        w.mat(p + "proj.weight", d.n_embd, n_pl)
        w.norm(p + "post_norm.weight", d.n_embd, center=0.3)
    return kv


def spec_gemma4_moe(d: Dims, w: Weights) -> dict:
    """Gemma 4 like 26B-A4B: 4 layers (S S S F), each a dense FFN beside 4 experts (2 used,
    fused gate+up, a per-expert output scale) routed from the normed residual; the full layer
    has no V projection (V from K); no per-layer embeddings, no shared KV, an output matrix."""
    a = "gemma4"
    swa = [True, True, True, False]
    d = dataclasses.replace(d, n_layer=len(swa))
    head_full, head_swa, n_ff_exp = 32, 16, 32
    kv = gemma4_kv(a, d, swa, head_full=head_full, head_swa=head_swa, n_head_kv_full=1)
    kv[f"{a}.embedding_length_per_layer_input"] = 0
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = n_ff_exp
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    gemma4_rope_freqs(w, head_full)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        gemma4_layer(w, p, d, n_head_kv=d.n_head_kv if swa[il] else 1, head_dim=head_swa if swa[il] else head_full,
                     n_ff=d.n_ff, v=swa[il])
        w.mat(p + "ffn_gate_inp.weight", d.n_expert, d.n_embd, gain=4.0)
        w.norm(p + "ffn_gate_inp.scale", d.n_embd)
        w.norm(p + "pre_ffw_norm_2.weight", d.n_embd)
        w.norm(p + "post_ffw_norm_1.weight", d.n_embd, center=0.3)
        w.norm(p + "post_ffw_norm_2.weight", d.n_embd, center=0.3)
        w.mat(p + "ffn_gate_up_exps.weight", 2 * n_ff_exp, d.n_embd, n_exp=d.n_expert)
        w.mat(p + "ffn_down_exps.weight", d.n_embd, n_ff_exp, n_exp=d.n_expert)
        w.norm(p + "ffn_down_exps.scale", d.n_expert)
    return kv


def spec_hunyuan_moe(d: Dims, w: Weights) -> dict:
    """Hunyuan-MoE: 2 layers of Q/K-normed (after rope) attention and 4 SiLU experts (2 used,
    renormalized) beside a shared expert of another width; experts feed_forward_length wide."""
    a = "hunyuan-moe"
    kv = base_kv(a, d)
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = d.n_ff
    kv[f"{a}.expert_shared_feed_forward_length"] = 96
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, d.n_ff)
        w.mat(p + "ffn_gate_shexp.weight", 96, d.n_embd)
        w.mat(p + "ffn_up_shexp.weight", 96, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 96)
    output(w, d)
    return kv


def spec_glm4moe(d: Dims, w: Weights) -> dict:
    """GLM-4.5: a dense layer, a sigmoid MoE layer (selection bias, renormalized and scaled
    weights, a shared expert), half-head NEOX rope, Q/K norms, and a NextN (MTP) block after
    the trunk that neither engine runs."""
    a = "glm4moe"
    d = dataclasses.replace(d, n_layer=3)
    kv = base_kv(a, d)
    kv[f"{a}.rope.dimension_count"] = d.head_dim // 2
    kv[f"{a}.nextn_predict_layers"] = 1
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    kv[f"{a}.expert_shared_count"] = 1
    kv[f"{a}.leading_dense_block_count"] = 1
    kv[f"{a}.expert_weights_scale"] = 2.5
    kv[f"{a}.expert_weights_norm"] = True
    kv[f"{a}.expert_gating_func"] = 2
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        if il == 0:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
            continue
        moe(w, p, d, 32)
        w.bias(p + "exp_probs_b.bias", d.n_expert, scale=0.5)
        w.mat(p + "ffn_gate_shexp.weight", 32, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, 32)
        w.mat(p + "ffn_up_shexp.weight", 32, d.n_embd)
        if il == d.n_layer - 1:             # the MTP block
            w.mat(p + "nextn.eh_proj.weight", d.n_embd, 2 * d.n_embd)
            w.norm(p + "nextn.enorm.weight", d.n_embd)
            w.norm(p + "nextn.hnorm.weight", d.n_embd)
    return kv


def spec_olmoe(d: Dims, w: Weights) -> dict:
    """OLMoE: full-width Q/K norms (so as many KV heads as heads), softmax experts of width n_ff."""
    a = "olmoe"
    d = dataclasses.replace(d, n_head_kv=d.n_head, n_ff=32)
    kv = base_kv(a, d)
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, d.n_ff)
    return kv


def spec_exaone4(d: Dims, w: Weights) -> dict:
    """EXAONE 4 (the small variant: rope on every layer, no window), with a NextN block."""
    a = "exaone4"
    d = dataclasses.replace(d, n_layer=3)
    kv = base_kv(a, d)
    kv[f"{a}.nextn_predict_layers"] = 1
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.norm(p + "post_ffw_norm.weight", d.n_embd)
        if il == d.n_layer - 1:
            w.mat(p + "nextn.eh_proj.weight", d.n_embd, 2 * d.n_embd)
            w.norm(p + "nextn.enorm.weight", d.n_embd)
            w.norm(p + "nextn.hnorm.weight", d.n_embd)
    return kv


def spec_deepseek2(d: Dims, w: Weights) -> dict:
    """DeepSeek-V3-style MLA (q rank 32, kv rank 32, 8 rope + 8 no-rope dims per head, 16 per
    value head; the cache row is 32 + 8), a dense layer, then sigmoid experts with a selection
    bias in 2 groups of which 1 stays selectable, renormalized and scaled, plus a shared expert.
    YaRN as the real files have it (factor 4 over an original context of 8, so the 16-token
    sequence runs past it; yarn_log_multiplier 0.1, which llama.cpp reads as 1.0)."""
    a = "deepseek2"
    q_rank, kv_rank, n_rot, nope, v_head, n_ff_exp = 32, 32, 8, 8, 16, 16
    kv = base_kv(a, d)
    kv.update({f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": kv_rank + n_rot,
               f"{a}.attention.value_length": kv_rank, f"{a}.attention.key_length_mla": nope + n_rot,
               f"{a}.attention.value_length_mla": v_head, f"{a}.attention.q_lora_rank": q_rank,
               f"{a}.attention.kv_lora_rank": kv_rank, f"{a}.rope.dimension_count": n_rot,
               f"{a}.leading_dense_block_count": 1, f"{a}.expert_count": d.n_expert,
               f"{a}.expert_used_count": d.n_expert_used, f"{a}.expert_feed_forward_length": n_ff_exp,
               f"{a}.expert_shared_count": 1, f"{a}.expert_weights_scale": 2.5, f"{a}.expert_weights_norm": True,
               f"{a}.expert_gating_func": 2, f"{a}.expert_group_count": 2, f"{a}.expert_group_used_count": 1})
    kv.update(yarn_kv(a, factor=4.0, n_ctx_orig=8))
    kv[f"{a}.rope.scaling.yarn_log_multiplier"] = 0.1
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "attn_q_a_norm.weight", q_rank)
        w.norm(p + "attn_kv_a_norm.weight", kv_rank)
        w.mat(p + "attn_q_a.weight", q_rank, d.n_embd)
        w.mat(p + "attn_q_b.weight", d.n_head * (nope + n_rot), q_rank)
        w.mat(p + "attn_kv_a_mqa.weight", kv_rank + n_rot, d.n_embd)
        w.mat(p + "attn_k_b.weight", kv_rank, nope, n_exp=d.n_head)        # [n_head, kv_rank, nope]
        w.mat(p + "attn_v_b.weight", v_head, kv_rank, n_exp=d.n_head)      # [n_head, v_head, kv_rank]
        w.mat(p + "attn_output.weight", d.n_embd, d.n_head * v_head)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        if il == 0:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
            continue
        w.mat(p + "ffn_gate_inp.weight", d.n_expert, d.n_embd, gain=4.0)
        w.bias(p + "exp_probs_b.bias", d.n_expert, scale=0.5)
        w.mat(p + "ffn_down_exps.weight", d.n_embd, n_ff_exp, n_exp=d.n_expert)
        w.mat(p + "ffn_gate_exps.weight", n_ff_exp, d.n_embd, n_exp=d.n_expert)
        w.mat(p + "ffn_up_exps.weight", n_ff_exp, d.n_embd, n_exp=d.n_expert)
        w.mat(p + "ffn_gate_shexp.weight", n_ff_exp, d.n_embd)
        w.mat(p + "ffn_down_shexp.weight", d.n_embd, n_ff_exp)
        w.mat(p + "ffn_up_shexp.weight", n_ff_exp, d.n_embd)
    return kv


def spec_minimax_m2(d: Dims, w: Weights) -> dict:
    """MiniMax-M2: all-heads Q/K norms (GQA), half-head NEOX rope, sigmoid experts with a
    selection bias in every layer."""
    a = "minimax-m2"
    d = dataclasses.replace(d, n_ff=32)
    kv = base_kv(a, d)
    kv.update({f"{a}.rope.dimension_count": d.head_dim // 2, f"{a}.expert_count": d.n_expert,
               f"{a}.expert_used_count": d.n_expert_used, f"{a}.expert_feed_forward_length": d.n_ff,
               f"{a}.expert_gating_func": 2})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.n_head_kv * d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        moe(w, p, d, d.n_ff)
        w.bias(p + "exp_probs_b.bias", d.n_expert, scale=0.5)
    return kv


def spec_smollm3(d: Dims, w: Weights) -> dict:
    d = dataclasses.replace(d, n_layer=4)      # layer 3 is the NoPE one
    kv = base_kv("smollm3", d)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        llama_block(w, p, d)
    return kv


def spec_mistral3(d: Dims, w: Weights) -> dict:
    a = "mistral3"
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.attention.temperature_scale"] = 0.5
    kv[f"{a}.rope.scaling.original_context_length"] = 4     # the temperature steps every 4 positions
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        llama_block(w, p, d)
    return kv


def spec_exaone(d: Dims, w: Weights) -> dict:
    a = "exaone"
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 500000.0
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        llama_block(w, p, d)
    return kv


def spec_llama4(d: Dims, w: Weights) -> dict:
    d = dataclasses.replace(d, n_layer=4)      # layer 3 is NoPE; layers 1 and 3 are MoE
    a = "llama4"
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 500000.0
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 64
    kv[f"{a}.interleave_moe_layer_step"] = 2
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        if (il + 1) % 2 == 0:
            moe(w, p, d, 64)
            w.mat(p + "ffn_gate_shexp.weight", 64, d.n_embd)
            w.mat(p + "ffn_down_shexp.weight", d.n_embd, 64)
            w.mat(p + "ffn_up_shexp.weight", 64, d.n_embd)
        else:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def spec_starcoder2(d: Dims, w: Weights) -> dict:
    kv = base_kv("starcoder2", d, rms=False)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d, norm_bias=True)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.bias(p + "attn_norm.bias", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.bias(p + "attn_output.bias", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.bias(p + "ffn_norm.bias", d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.bias(p + "ffn_down.bias", d.n_embd)
        w.bias(p + "ffn_up.bias", d.n_ff)
    return kv


def spec_gpt2(d: Dims, w: Weights) -> dict:
    d = dataclasses.replace(d, n_head_kv=d.n_head)
    kv = base_kv("gpt2", d, rms=False, rope=False)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    w.embd("position_embd.weight", d.n_ctx_train, d.n_embd, scale=0.3)
    output(w, d, norm_bias=True)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.bias(p + "attn_norm.bias", d.n_embd)
        w.mat(p + "attn_qkv.weight", 3 * d.n_embd, d.n_embd)
        w.bias(p + "attn_qkv.bias", 3 * d.n_embd)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.bias(p + "attn_output.bias", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.bias(p + "ffn_norm.bias", d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.bias(p + "ffn_down.bias", d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.bias(p + "ffn_up.bias", d.n_ff)
    return kv


def spec_phi2(d: Dims, w: Weights) -> dict:
    d = dataclasses.replace(d, n_head_kv=d.n_head)
    kv = base_kv("phi2", d, rms=False)
    kv["phi2.rope.dimension_count"] = d.head_dim // 2     # partial rotary
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d, norm_bias=True, out_bias=True)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.bias(p + "attn_norm.bias", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.bias(p + "attn_output.bias", d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.bias(p + "ffn_down.bias", d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.bias(p + "ffn_up.bias", d.n_ff)
    return kv


def yarn_kv(arch: str, *, factor: float, n_ctx_orig: int) -> dict[str, object]:
    """The rope scaling keys of a YaRN model (convert_hf_to_gguf's names)."""
    return {f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": factor,
            f"{arch}.rope.scaling.original_context_length": n_ctx_orig}


def spec_gpt_oss(d: Dims, w: Weights) -> dict:
    """GPT-OSS with YaRN as its files have it (factor 32 there; here 4 over an original
    context of 8, so the 16-token sequence runs past it)."""
    a = "gpt-oss"
    kv = base_kv(a, d)
    kv.update(yarn_kv(a, factor=4.0, n_ctx_orig=8))
    kv[f"{a}.rope.freq_base"] = 150000.0
    kv[f"{a}.attention.key_length"] = d.head_dim
    kv[f"{a}.attention.value_length"] = d.head_dim
    kv[f"{a}.attention.sliding_window"] = 4
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 64
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.bias(p + "attn_sinks.weight", d.n_head, scale=1.0)
        moe(w, p, d, 64)
        w.bias(p + "attn_output.bias", d.n_embd)
        w.bias(p + "ffn_gate_inp.bias", d.n_expert)
        w.bias(p + "ffn_gate_exps.bias", d.n_expert, 64)
        w.bias(p + "ffn_down_exps.bias", d.n_expert, d.n_embd)
        w.bias(p + "ffn_up_exps.bias", d.n_expert, 64)
    return kv


def _bert_common(a: str, d: Dims, w: Weights, *, pos: bool) -> dict:
    d = dataclasses.replace(d, n_head_kv=d.n_head)
    kv = base_kv(a, d, rms=False, rope=not pos)
    kv[f"{a}.attention.causal"] = False
    kv[f"{a}.pooling_type"] = 1     # mean
    kv["tokenizer.ggml.token_type_count"] = 2
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    w.embd("token_types.weight", 2, d.n_embd, scale=0.3)
    if pos:
        w.embd("position_embd.weight", d.n_ctx_train, d.n_embd, scale=0.3)
    w.norm("token_embd_norm.weight", d.n_embd)
    w.bias("token_embd_norm.bias", d.n_embd)
    return kv


def spec_bert(d: Dims, w: Weights) -> dict:
    kv = _bert_common("bert", d, w, pos=True)
    kv["bert.classifier.output_labels"] = ["no", "yes"]
    for il in range(d.n_layer):
        p = f"blk.{il}."
        for x in ("q", "k", "v"):
            w.mat(p + f"attn_{x}.weight", d.n_embd, d.n_embd)
            w.bias(p + f"attn_{x}.bias", d.n_embd)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.bias(p + "attn_output.bias", d.n_embd)
        w.norm(p + "attn_output_norm.weight", d.n_embd)
        w.bias(p + "attn_output_norm.bias", d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.bias(p + "ffn_up.bias", d.n_ff)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.bias(p + "ffn_down.bias", d.n_embd)
        w.norm(p + "layer_output_norm.weight", d.n_embd)
        w.bias(p + "layer_output_norm.bias", d.n_embd)
    w.mat("cls.weight", d.n_embd, d.n_embd)
    w.bias("cls.bias", d.n_embd)
    w.mat("cls.output.weight", 2, d.n_embd)
    w.bias("cls.output.bias", 2)
    return kv


def spec_nomic_bert(d: Dims, w: Weights) -> dict:
    kv = _bert_common("nomic-bert", d, w, pos=False)
    kv["nomic-bert.rope.freq_base"] = 1000.0
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.mat(p + "attn_qkv.weight", 3 * d.n_embd, d.n_embd)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_output_norm.weight", d.n_embd)
        w.bias(p + "attn_output_norm.bias", d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.norm(p + "layer_output_norm.weight", d.n_embd)
        w.bias(p + "layer_output_norm.bias", d.n_embd)
    return kv


def ssm_kv(a: str, d: Dims, *, d_state: int, dt_rank: int, n_group: int = 0) -> dict:
    """A recurrent model's keys: no heads, no FFN, no rope; the SSM sizes (inner = 2 n_embd)."""
    kv = base_kv(a, d, rope=False)
    kv[f"{a}.attention.head_count"] = 0
    kv[f"{a}.attention.head_count_kv"] = 0
    kv[f"{a}.feed_forward_length"] = 0
    kv.update({f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.inner_size": 2 * d.n_embd, f"{a}.ssm.state_size": d_state,
               f"{a}.ssm.time_step_rank": dt_rank})
    if n_group:
        kv[f"{a}.ssm.group_count"] = n_group
    return kv


def mamba2_block(w: Weights, p: str, d: Dims, *, d_state: int, n_head: int, n_group: int,
                 d_inner: int = 0) -> None:
    """A Mamba-2 block's tensors: A = -exp(.) per head (a decay), dt bias around softplus's knee;
    inner width 2 n_embd unless given."""
    d_inner = d_inner or 2 * d.n_embd
    conv_dim = d_inner + 2 * n_group * d_state
    w.mat(p + "ssm_in.weight", d_inner + conv_dim + n_head, d.n_embd)
    w.mat(p + "ssm_conv1d.weight", conv_dim, 4)
    w.bias(p + "ssm_conv1d.bias", conv_dim)
    w.bias(p + "ssm_dt.bias", n_head, scale=0.5)
    w.t[p + "ssm_a"] = -np.exp(0.5 * w.rng.standard_normal((n_head, 1))).astype(np.float32)
    w.t[p + "ssm_d"] = (1.0 + 0.1 * w.rng.standard_normal((n_head, 1))).astype(np.float32)
    w.t[p + "ssm_norm.weight"] = (1.0 + 0.1 * w.rng.standard_normal((n_group, d_inner // n_group))).astype(np.float32)
    w.mat(p + "ssm_out.weight", d.n_embd, d_inner)


def spec_mamba(d: Dims, w: Weights) -> dict:
    """Mamba: 2 SSM layers (inner 128, state 16, dt rank 8); A = -exp(.) per channel and state."""
    a, d_state, dt_rank = "mamba", 16, 8
    kv = ssm_kv(a, d, d_state=d_state, dt_rank=dt_rank)
    d_inner = 2 * d.n_embd
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.mat(p + "ssm_in.weight", 2 * d_inner, d.n_embd)
        w.mat(p + "ssm_conv1d.weight", d_inner, 4)
        w.bias(p + "ssm_conv1d.bias", d_inner)
        w.mat(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
        w.mat(p + "ssm_dt.weight", d_inner, dt_rank)
        w.bias(p + "ssm_dt.bias", d_inner, scale=0.5)
        w.t[p + "ssm_a"] = -np.exp(0.5 * w.rng.standard_normal((d_inner, d_state))).astype(np.float32)
        w.t[p + "ssm_d"] = (1.0 + 0.1 * w.rng.standard_normal(d_inner)).astype(np.float32)
        w.mat(p + "ssm_out.weight", d.n_embd, d_inner)
    output(w, d)
    return kv


def spec_mamba2(d: Dims, w: Weights) -> dict:
    """Mamba-2: 2 SSM layers of 8 heads of 16 (2 groups for B and C, state 16)."""
    a = "mamba2"
    kv = ssm_kv(a, d, d_state=16, dt_rank=8, n_group=2)
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mamba2_block(w, p, d, d_state=16, n_head=8, n_group=2)
    output(w, d)
    return kv


def spec_granitehybrid(d: Dims, w: Weights) -> dict:
    """Granite 4 hybrid: 4 layers, Mamba-2 / attention / Mamba-2 / attention (head_count_kv 0
    marks the recurrent ones), gated FFNs, Granite's residual, attention and logit scales."""
    a = "granitehybrid"
    d = dataclasses.replace(d, n_layer=4)
    kv = ssm_kv(a, d, d_state=16, dt_rank=8, n_group=2)
    kv[f"{a}.attention.head_count"] = d.n_head
    kv[f"{a}.attention.head_count_kv"] = [0, d.n_head_kv, 0, d.n_head_kv]
    kv[f"{a}.feed_forward_length"] = d.n_ff
    kv[f"{a}.rope.freq_base"] = 10000.0
    kv[f"{a}.rope.dimension_count"] = d.head_dim
    kv.update({f"{a}.residual_scale": 0.5, f"{a}.attention.scale": 0.2, f"{a}.logit_scale": 2.0,
               f"{a}.embedding_scale": 3.0})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        if il % 2 == 0:
            mamba2_block(w, p, d, d_state=16, n_head=8, n_group=2)
        else:
            attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    output(w, d)
    return kv


def spec_nemotron_h(d: Dims, w: Weights) -> dict:
    """Nemotron-H: 4 layers, Mamba-2 / attention (no rope) / squared-ReLU FFN / Mamba-2: KV heads
    mark attention, an FFN width the FFN layers, neither the Mamba-2 ones."""
    a = "nemotron_h"
    d = dataclasses.replace(d, n_layer=4)
    kv = ssm_kv(a, d, d_state=16, dt_rank=8, n_group=2)
    kv[f"{a}.attention.head_count"] = d.n_head
    kv[f"{a}.attention.head_count_kv"] = [0, d.n_head_kv, 0, 0]
    kv[f"{a}.feed_forward_length"] = [0, 0, d.n_ff, 0]
    kv[f"{a}.attention.key_length"] = kv[f"{a}.attention.value_length"] = d.head_dim
    kv[f"{a}.attention.layer_norm_epsilon"] = 1e-5
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        if il == 1:
            attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        elif il == 2:
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        else:
            mamba2_block(w, p, d, d_state=16, n_head=8, n_group=2)
    output(w, d)
    return kv


def spec_lfm2(d: Dims, w: Weights) -> dict:
    """LFM2: 4 layers, short conv / attention / short conv / attention (head_count_kv 0 marks
    the conv ones; kernel width 3 as the released models), gated FFNs, Q/K norms, the output
    norm named token_embd_norm and the output tied to the embeddings."""
    a = "lfm2"
    d = dataclasses.replace(d, n_layer=4)
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.attention.head_count_kv"] = [0, d.n_head_kv, 0, d.n_head_kv]
    kv[f"{a}.shortconv.l_cache"] = 3
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=0.4)      # tied: logits of a few units
    w.norm("token_embd_norm.weight", d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.norm(p + "attn_norm.weight", d.n_embd)
        if il % 2:
            w.norm(p + "attn_q_norm.weight", d.head_dim)
            w.norm(p + "attn_k_norm.weight", d.head_dim)
            attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        else:
            w.t[p + "shortconv.conv.weight"] = (w.rng.standard_normal((d.n_embd, 3)) / np.sqrt(3)).astype(np.float32)
            w.mat(p + "shortconv.in_proj.weight", 3 * d.n_embd, d.n_embd)
            w.mat(p + "shortconv.out_proj.weight", d.n_embd, d.n_embd)
    return kv


def spec_lfm2moe(d: Dims, w: Weights) -> dict:
    """LFM2-MoE: LFM2's 4 layers (short conv / attention / short conv / attention), the first 2
    dense, then a sigmoid-gated mixture of 4 experts (2 used, width 32) with a selection bias."""
    a = "lfm2moe"
    d = dataclasses.replace(d, n_layer=4)
    kv = base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 1000000.0
    kv[f"{a}.attention.head_count_kv"] = [0, d.n_head_kv, 0, d.n_head_kv]
    kv.update({f"{a}.shortconv.l_cache": 3, f"{a}.leading_dense_block_count": 2, f"{a}.expert_count": d.n_expert,
               f"{a}.expert_used_count": d.n_expert_used, f"{a}.expert_feed_forward_length": 32,
               f"{a}.expert_gating_func": 2})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd, scale=0.4)
    w.norm("token_embd_norm.weight", d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "ffn_norm.weight", d.n_embd)
        if il >= 2:
            moe(w, p, d, 32)
            w.bias(p + "exp_probs_b.bias", d.n_expert)
        else:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.norm(p + "attn_norm.weight", d.n_embd)
        if il % 2:
            w.norm(p + "attn_q_norm.weight", d.head_dim)
            w.norm(p + "attn_k_norm.weight", d.head_dim)
            attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        else:
            w.t[p + "shortconv.conv.weight"] = (w.rng.standard_normal((d.n_embd, 3)) / np.sqrt(3)).astype(np.float32)
            w.mat(p + "shortconv.in_proj.weight", 3 * d.n_embd, d.n_embd)
            w.mat(p + "shortconv.out_proj.weight", d.n_embd, d.n_embd)
    return kv


def spec_falcon_h1(d: Dims, w: Weights) -> dict:
    """Falcon-H1: 2 layers, each attention (NEOX rope) and a Mamba-2 block in parallel (inner
    width 96 = 6 heads of 16, 2 groups, state 16) over one norm, then a gated FFN; the FFN norm
    has no .weight suffix, as llama.cpp's loader names it."""
    a = "falcon-h1"
    kv = base_kv(a, d)
    kv.update({f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.inner_size": 96, f"{a}.ssm.state_size": 16,
               f"{a}.ssm.time_step_rank": 6, f"{a}.ssm.group_count": 2})
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        mamba2_block(w, p, d, d_state=16, n_head=6, n_group=2, d_inner=96)
        attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "ffn_norm", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    output(w, d)
    return kv


def spec_jamba(d: Dims, w: Weights) -> dict:
    """Jamba: 4 layers, Mamba / attention (no rope) / Mamba / attention with a gated FFN on
    layers 0 and 3 and a softmax mixture of 4 experts (2 used) on 1 and 2; Mamba-1 blocks (inner
    128, state 16, dt rank 8) with Jamba's RMS norms of dt, B and C."""
    a, d_state, dt_rank = "jamba", 16, 8
    d = dataclasses.replace(d, n_layer=4)
    kv = ssm_kv(a, d, d_state=d_state, dt_rank=dt_rank)
    kv[f"{a}.attention.head_count"] = d.n_head
    kv[f"{a}.attention.head_count_kv"] = [0, d.n_head_kv, 0, d.n_head_kv]
    kv[f"{a}.feed_forward_length"] = d.n_ff
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    d_inner = 2 * d.n_embd
    w.embd("token_embd.weight", N_VOCAB, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        if il % 2 == 0:
            w.mat(p + "ssm_in.weight", 2 * d_inner, d.n_embd)
            w.mat(p + "ssm_conv1d.weight", d_inner, 4)
            w.bias(p + "ssm_conv1d.bias", d_inner)
            w.mat(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
            w.norm(p + "ssm_dt_norm.weight", dt_rank)
            w.mat(p + "ssm_dt.weight", d_inner, dt_rank)
            w.bias(p + "ssm_dt.bias", d_inner, scale=0.5)
            w.norm(p + "ssm_b_norm.weight", d_state)
            w.norm(p + "ssm_c_norm.weight", d_state)
            w.t[p + "ssm_a"] = -np.exp(0.5 * w.rng.standard_normal((d_inner, d_state))).astype(np.float32)
            w.t[p + "ssm_d"] = (1.0 + 0.1 * w.rng.standard_normal(d_inner)).astype(np.float32)
            w.mat(p + "ssm_out.weight", d.n_embd, d_inner)
        else:
            attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        if il in (1, 2):
            moe(w, p, d, d.n_ff)
        else:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    output(w, d)
    return kv


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    build: Callable[[Dims, Weights], dict]
    seed: int
    vocab: str = "spm"              # spm | wpm
    encoder: bool = False           # no logits, embeddings only
    qtype: str = "Q8_0"             # quantized fixture: matrices in this type (MXFP4: experts MXFP4, rest Q8_0)
    rank: bool = False              # has a classifier head (pooling "rank")


ARCHS: dict[str, ArchSpec] = {
    "bert": ArchSpec(spec_bert, 101, vocab="wpm", encoder=True, rank=True),
    "nomic-bert": ArchSpec(spec_nomic_bert, 102, vocab="wpm", encoder=True),
    "qwen3moe": ArchSpec(spec_qwen3moe, 103),
    "qwen2moe": ArchSpec(spec_qwen2moe, 104),
    "olmo2": ArchSpec(spec_olmo2, 105),
    "granite": ArchSpec(spec_granite, 106),
    "smollm3": ArchSpec(spec_smollm3, 107),
    "starcoder2": ArchSpec(spec_starcoder2, 108),
    "gpt2": ArchSpec(spec_gpt2, 109),
    "qwen35": ArchSpec(spec_qwen35, 147),
    "qwen35moe": ArchSpec(spec_qwen35moe, 150),
    "qwen3next": ArchSpec(spec_qwen3next, 149),
    "phi2": ArchSpec(spec_phi2, 110),
    "gpt-oss": ArchSpec(spec_gpt_oss, 111, qtype="MXFP4"),
    "mistral3": ArchSpec(spec_mistral3, 112),
    "exaone": ArchSpec(spec_exaone, 113),
    "mamba": ArchSpec(spec_mamba, 140),
    "mamba2": ArchSpec(spec_mamba2, 141),
    "granitehybrid": ArchSpec(spec_granitehybrid, 142),
    "nemotron_h": ArchSpec(spec_nemotron_h, 143),
    "lfm2": ArchSpec(spec_lfm2, 144),
    "falcon-h1": ArchSpec(spec_falcon_h1, 145),
    "jamba": ArchSpec(spec_jamba, 146),
    "lfm2moe": ArchSpec(spec_lfm2moe, 147),
    "llama4": ArchSpec(spec_llama4, 114),
    "granitemoe": ArchSpec(spec_granitemoe, 115),
    "command-r": ArchSpec(spec_command_r, 116),
    "cohere2": ArchSpec(spec_cohere2, 117),
    "glm4": ArchSpec(spec_glm4, 118),
    "ernie4_5": ArchSpec(spec_ernie4_5, 119),
    "ernie4_5-moe": ArchSpec(spec_ernie4_5_moe, 120),
    "seed_oss": ArchSpec(spec_seed_oss, 121),
    "apertus": ArchSpec(spec_apertus, 151),
    "qwen2vl": ArchSpec(spec_qwen2vl, 122),
    "qwen3vl": ArchSpec(spec_qwen3vl, 123),
    "glm4moe": ArchSpec(spec_glm4moe, 124),
    "olmoe": ArchSpec(spec_olmoe, 125),
    "exaone4": ArchSpec(spec_exaone4, 126),
    "deepseek2": ArchSpec(spec_deepseek2, 129),
    "minimax-m2": ArchSpec(spec_minimax_m2, 128),
    "qwen3vlmoe": ArchSpec(spec_qwen3vlmoe, 129),
    "gemma3n": ArchSpec(spec_gemma3n, 130),
    "gemma4": ArchSpec(spec_gemma4, 131),
    "gemma4-moe": ArchSpec(spec_gemma4_moe, 132),
    "hunyuan-moe": ArchSpec(spec_hunyuan_moe, 133),
}


# ---- vocabularies ----------------------------------------------------------------------------


def corpus_texts() -> list[str]:
    """The distinct texts of the tokenizer corpus (tests/data/tokenizer), in order."""
    seen: dict[str, None] = {}
    for line in gzip.open(CORPUS, "rt", encoding="utf-8"):
        seen.setdefault(json.loads(line)["text"], None)
    return list(seen)


def spm_vocab_kv() -> list[tuple[str, object, object, object]]:
    from ggmlx import gguf
    with gguf.GGUFReader(SPM_VOCAB_MODEL) as f:
        return [(k, v, f.kv_types[k], f.kv_array_types.get(k))
                for k, v in f.kv.items() if k.startswith("tokenizer.ggml.")]


def _bert_words(texts: list[str]) -> tuple[list[str], list[str]]:
    """Lowercased, accent-stripped word and character inventories of the corpus (by frequency)."""
    counts: dict[str, int] = {}
    chars: dict[str, int] = {}
    for text in texts:
        norm = "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")
        for word in "".join(c if c.isalnum() else " " for c in norm).split():
            counts[word] = counts.get(word, 0) + 1
        for c in norm:
            if not c.isspace() and unicodedata.category(c)[0] != "C":
                chars[c] = chars.get(c, 0) + 1
    by_freq = sorted(counts, key=lambda w: (-counts[w], w))
    return by_freq, sorted(chars, key=lambda c: (-chars[c], c))


def wpm_vocab_kv() -> list[tuple[str, object, object, object]]:
    """A 512-token WordPiece vocabulary in llama.cpp's GGUF form: [PAD] 0, [unusedN] 1-99,
    [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103, then word-initial pieces ("\u2581" + piece)
    and continuation pieces (no "##"), made from the tokenizer corpus: the 96 most frequent
    characters in both forms, then frequent words and word endings."""
    from ggmlx.gguf import GGUFValueType as VT
    words, chars = _bert_words(corpus_texts())
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    types = [3] + [1] * 99 + [3, 3, 3, 3]
    seen = set(tokens)

    def add(t: str) -> None:
        if t not in seen and len(tokens) < N_VOCAB:
            seen.add(t)
            tokens.append(t)
            types.append(1)

    for c in chars[:96]:
        add("\u2581" + c)
        add(c)
    for word in words:
        if len(word) > 1:
            add("\u2581" + word)
        if len(word) > 4:
            add(word[-3:])
            add(word[:3])
    assert len(tokens) == N_VOCAB, len(tokens)
    return [
        ("tokenizer.ggml.model", "bert", VT.STRING, None),
        ("tokenizer.ggml.pre", "default", VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.scores", [0.0] * N_VOCAB, VT.ARRAY, VT.FLOAT32),
        ("tokenizer.ggml.unknown_token_id", 100, VT.UINT32, None),
        ("tokenizer.ggml.cls_token_id", 101, VT.UINT32, None),
        ("tokenizer.ggml.seperator_token_id", 102, VT.UINT32, None),
        ("tokenizer.ggml.padding_token_id", 0, VT.UINT32, None),
        ("tokenizer.ggml.mask_token_id", 103, VT.UINT32, None),
        ("tokenizer.ggml.bos_token_id", 101, VT.UINT32, None),
    ]


def ugm_vocab_kv() -> list[tuple[str, object, object, object]]:
    """A 512-token Unigram (T5-style) vocabulary: <pad> 0, </s> 1, <unk> 2, a user-defined
    "<extra_id_0>", then "\u2581" + word / word / character pieces from the corpus with
    log-probability scores that favour longer pieces; and a precompiled charsmap (CHARSMAP)."""
    from ggmlx.gguf import GGUFValueType as VT
    texts = corpus_texts()
    counts: dict[str, int] = {}
    chars: dict[str, int] = {}
    for text in texts:
        for word in text.split():
            counts["\u2581" + word] = counts.get("\u2581" + word, 0) + 1
        for c in text:
            if not c.isspace():
                chars[c] = chars.get(c, 0) + 1
    tokens = ["<pad>", "</s>", "<unk>", "<extra_id_0>"]
    types = [3, 3, 2, 4]
    scores = [0.0, 0.0, 0.0, 0.0]
    seen = set(tokens)

    def add(t: str, score: float) -> None:
        if t not in seen and len(tokens) < N_VOCAB:
            seen.add(t)
            tokens.append(t)
            types.append(1)
            scores.append(score)

    add("\u2581", -2.0)
    for c in sorted(chars, key=lambda c: (-chars[c], c))[:160]:
        add(c, -8.0 - 1.0 / chars[c])
        add("\u2581" + c, -7.0 - 1.0 / chars[c])
    for word in sorted(counts, key=lambda w: (-counts[w], w)):
        n = len(word)
        add(word, -3.0 - 0.25 * n - 1.0 / counts[word])
        if n > 5:
            add(word[:4], -5.0 - 0.1 * n)
            add(word[4:], -6.0 - 0.1 * n)
    assert len(tokens) == N_VOCAB, len(tokens)
    return [
        ("tokenizer.ggml.model", "t5", VT.STRING, None),
        ("tokenizer.ggml.pre", "default", VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.scores", scores, VT.ARRAY, VT.FLOAT32),
        ("tokenizer.ggml.add_space_prefix", True, VT.BOOL, None),
        ("tokenizer.ggml.remove_extra_whitespaces", True, VT.BOOL, None),
        ("tokenizer.ggml.eos_token_id", 1, VT.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 2, VT.UINT32, None),
        ("tokenizer.ggml.padding_token_id", 0, VT.UINT32, None),
        ("tokenizer.ggml.precompiled_charsmap", list(precompiled_charsmap(CHARSMAP)), VT.ARRAY, VT.UINT8),
    ]


def gemma4_vocab_kv() -> list[tuple[str, object, object, object]]:
    """A 1024-token Gemma 4 style vocabulary (SPM-style BPE over raw UTF-8): <pad>, <eos>,
    <bos>, <unk>, two control turn markers, the 256 byte tokens <0x00>..<0xFF>, the newline
    runs "\n" and "\n\n" (whole-newline words), the corpus characters seen at least twice
    ("\u2581" for a space; the rarer ones fall back to byte tokens), then merges learned
    greedily over whole lines (most frequent pair first, ties by the pair's text)."""
    from ggmlx.gguf import GGUFValueType as VT
    n_vocab = 1024
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += ["\n", "\n\n"]
    types += [1, 1]
    lines = [line.replace(" ", "\u2581") for text in corpus_texts() for line in text.split("\n") if line]
    chars: dict[str, int] = {}
    for line in lines:
        for c in line:
            chars[c] = chars.get(c, 0) + 1
    for c in sorted(chars, key=lambda c: (-chars[c], c)):
        if chars[c] >= 2 and c not in tokens:
            tokens.append(c)
            types.append(1)
    known = set(tokens)
    words = [[c if c in known else "" for c in line] for line in lines]
    merges: list[str] = []
    while len(tokens) < n_vocab:
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:], strict=False):
                if a and b:
                    pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{a} {b}")
        if a + b not in known:          # "ab"+"c" and "a"+"bc": one token, two merges
            known.add(a + b)
            tokens.append(a + b)
            types.append(1)
        for k, w in enumerate(words):
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[k] = out
    return [
        ("tokenizer.ggml.model", "gemma4", VT.STRING, None),
        ("tokenizer.ggml.pre", "gemma4", VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.scores", [0.0] * len(tokens), VT.ARRAY, VT.FLOAT32),
        ("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.add_space_prefix", False, VT.BOOL, None),
        ("tokenizer.ggml.add_bos_token", True, VT.BOOL, None),
        ("tokenizer.ggml.bos_token_id", 2, VT.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 1, VT.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 3, VT.UINT32, None),
        ("tokenizer.ggml.padding_token_id", 0, VT.UINT32, None),
    ]


# A small normalization map in SentencePiece's precompiled form (the real ones hold NFKC):
# accents folded, ligatures and full-width forms expanded, odd spaces to " ", and prefixes
# that share bytes ("\u00e9" vs "\u00e9t"), so the longest match matters.
CHARSMAP = {
    "\u00e9": "e", "\u00e8": "e", "\u00e0": "a", "\u00fc": "u", "\u00e9t": "ET",
    "\ufb01": "fi", "\ufb02": "fl", "\u2122": "TM", "\u2026": "...",
    "\uff21": "A", "\uff41": "a", "\uff11": "1", "\u3000": " ", "\u00a0": " ", "\t": " ",
    "\u2019": "'", "\u201c": '"', "\u201d": '"',
}


def precompiled_charsmap(mapping: dict[str, str]) -> bytes:
    """The blob llama.cpp reads: uint32 size of the XCDA, the XCDA (uint32 entries: BASE in
    bits 10-30, LEAF bit 8, LCHECK = the label byte in bits 0-7, bit 31 marks a value entry),
    then the NUL-terminated replacements. Each trie node gets its own 256-entry block s, so
    its child for byte c sits at s ^ c = s + c and its value (if it ends a key) at s."""
    keys = {k.encode(): v.encode() for k, v in mapping.items()}
    repl = bytearray()
    offsets = {}
    for k in sorted(keys):
        offsets[k] = len(repl)
        repl += keys[k] + b"\0"
    prefixes = sorted({k[:i] for k in keys for i in range(len(k) + 1)})
    block = {p: 256 * (i + 1) for i, p in enumerate(prefixes)}     # block 0 holds the root entry
    xcda = [0] * (256 * (len(prefixes) + 1))
    xcda[0] = block[b""] << 10
    for p in prefixes:
        if p:
            idx = block[p[:-1]] + p[-1]
            base = idx ^ block[p]
            assert base < 1 << 21
            xcda[idx] = (base << 10) | ((p in keys) << 8) | p[-1]
        if p in keys:
            xcda[block[p]] = (1 << 31) | offsets[p]
    blob = np.asarray(xcda, "<u4").tobytes()
    return len(blob).to_bytes(4, "little") + blob + bytes(repl)


VOCABS = {"spm": spm_vocab_kv, "wpm": wpm_vocab_kv, "ugm": ugm_vocab_kv, "gemma4": gemma4_vocab_kv}


# ---- writing ---------------------------------------------------------------------------------


def write_gguf(path: Path, kv: dict[str, object], vocab: list, tensors: dict[str, np.ndarray],
               wtype: str = "F32", fixed: dict[str, str] | None = None) -> None:
    """kv, then the vocabulary keys, then the tensors; weight matrices (2-D and 3-D, not the
    1-D norms and biases, not the MoE router or the token-type rows) in `wtype`, the tensors
    named in `fixed` in their own type."""
    from ggmlx import gguf, quants
    from ggmlx.types import GGMLType
    w = gguf.GGUFWriter()
    for k, v in kv.items():
        w.add_kv(k, v)
    for k, v, vtype, atype in vocab:
        w.add_kv(k, v, vtype, atype)
    for name, x in tensors.items():
        quantize = (wtype != "F32" and x.ndim >= 2 and x.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name
                    and "token_types" not in name and not name.endswith(".bias")
                    # ggml's SSM ops read the conv kernels, A and D, and the norms in F32
                    and not name.endswith((".ssm_a", ".ssm_d", "ssm_norm.weight", "ssm_conv1d.weight")))
        if fixed and name in fixed:
            t = GGMLType[fixed[name]]
            w.add_tensor(name, quants.quantize(x, t), t, tuple(reversed(x.shape)))
        elif quantize and wtype == "MXFP4" and "_exps." in name:
            w.add_tensor(name, quantize_mxfp4(x), GGMLType.MXFP4, tuple(reversed(x.shape)))
        elif quantize:
            t = GGMLType.Q8_0 if wtype == "MXFP4" else GGMLType[wtype]
            w.add_tensor(name, quants.quantize(x, t), t, tuple(reversed(x.shape)))
        else:
            w.add_tensor(name, x)
    w.write(path)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """MXFP4 blocks of 32 (ggml's quantize_row_mxfp4_ref): one E8M0 exponent byte, then 16
    bytes of 4-bit E2M1 codes (element j low nibble, j + 16 high nibble), the code nearest
    to x / 2^(e - 128), first on ties."""
    from ggmlx.quants.iq_tables import KVALUES_MXFP4
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = np.ldexp(np.float32(1.0), e.astype(np.int32) - 128).astype(np.float32)
    grid = KVALUES_MXFP4.astype(np.float32)[None, None, :] * d[:, None, None]
    codes = np.abs(grid - blocks[:, :, None]).argmin(axis=2).astype(np.uint8)
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([e[:, None], qs], axis=1).reshape(-1)


def dequantized_twin(path: Path, twin: Path) -> None:
    """The same GGUF with every tensor dequantized to F32."""
    from ggmlx import gguf, quants
    with gguf.GGUFReader(path) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            w.add_tensor(name, np.ascontiguousarray(quants.dequantize(ti.data, ti.type, ti.ne), np.float32))
        w.write(twin)


def fixture_sequences(vocab: str) -> list[np.ndarray]:
    """Seeded token sequences: BOS ([CLS] for WordPiece) then random ordinary tokens ([SEP] last)."""
    rng = np.random.default_rng(7)
    out = []
    for n in SEQ_LENS:
        if vocab == "wpm":
            body = rng.integers(104, N_VOCAB, n - 2)
            out.append(np.concatenate([[101], body, [102]]).astype(np.int32))
        else:
            out.append(np.concatenate([[1], rng.integers(3, N_VOCAB, n - 1)]).astype(np.int32))
    return out


def make_arch(arch: str, out: Path = OUT) -> dict[str, Path]:
    """Write the F32 and quantized GGUFs of `arch`; returns their paths."""
    spec = ARCHS[arch]
    w = Weights(spec.seed)
    kv = spec.build(Dims(), w)
    vocab = VOCABS[spec.vocab]()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"F32": out / f"{arch}-F32.gguf", spec.qtype: out / f"{arch}-{spec.qtype}.gguf"}
    write_gguf(paths["F32"], kv, vocab, w.t, fixed=w.fixed)
    write_gguf(paths[spec.qtype], kv, vocab, w.t, spec.qtype, fixed=w.fixed)
    return paths


# ---- llama.cpp -------------------------------------------------------------------------------

POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_LOG_CALLBACK = None


def quiet_llamacpp(L) -> None:
    """Silence llama.cpp's logging (its loader and context print hundreds of lines)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = L.llama_log_callback(lambda level, text, user_data: None)
        L.llama_log_set(_LOG_CALLBACK, None)


class LlamaCpp:
    """One model in llama.cpp through llama-cpp-python's C API (CPU, 2 threads)."""

    def __init__(self, path: Path):
        import llama_cpp as L
        self.L = L
        quiet_llamacpp(L)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_embd = L.llama_model_n_embd(self.model)

    def close(self) -> None:
        self.L.llama_model_free(self.model)

    def run(self, tokens: np.ndarray, *, embeddings: bool = False, pooling: str = "none",
            loras: tuple[tuple[Path, float], ...] = ()):
        """One decode of all tokens (seq 0, positions 0..T-1, every token an output): the
        logits [T, n_vocab] (None for an encoder) and the embeddings ([T, n_embd] per token,
        or the pooled vector of seq 0); `loras`: LoRA adapter files and scales applied
        (llama_adapter_lora_init + llama_set_adapters_lora)."""
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = N_CTX
        cp.n_seq_max = 1
        cp.n_outputs_max_per_seq = 0
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = 0      # GGML_TYPE_F32
        cp.embeddings = embeddings
        cp.pooling_type = POOLING[pooling]
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        adapters = [L.llama_adapter_lora_init(self.model, str(p).encode()) for p, _ in loras]
        if not all(adapters):
            raise RuntimeError(f"llama.cpp could not load the LoRA adapters {[str(p) for p, _ in loras]}")
        if adapters:
            arr = (L.llama_adapter_lora_p_ctypes * len(adapters))(*adapters)
            scales = (ctypes.c_float * len(adapters))(*[s for _, s in loras])
            if L.llama_set_adapters_lora(ctx, arr, len(adapters), scales) != 0:
                raise RuntimeError("llama_set_adapters_lora failed")
        n = len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = n
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            logits = None
            if L.llama_model_has_decoder(self.model) and not L.llama_model_has_encoder(self.model) \
                    and not embeddings:
                logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (self.n_vocab,)).copy()
                                   for i in range(n)])
            embd = None
            if embeddings:
                if pooling == "none":
                    embd = np.stack([np.ctypeslib.as_array(L.llama_get_embeddings_ith(ctx, i), (self.n_embd,)).copy()
                                     for i in range(n)])
                else:
                    size = L.llama_model_n_cls_out(self.model) if pooling == "rank" else self.n_embd
                    embd = np.ctypeslib.as_array(L.llama_get_embeddings_seq(ctx, 0), (size,)).copy()
            return logits, embd
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
            for a in adapters:
                L.llama_adapter_lora_free(a)


def oracle_arrays(paths: dict[str, Path], spec: ArchSpec, tmp: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    seqs = fixture_sequences(spec.vocab)
    f32 = LlamaCpp(paths["F32"])
    poolings = ["none", "mean", "cls", "last"] + (["rank"] if spec.rank else [])
    for k, toks in enumerate(seqs):
        arrays[f"tokens_{k}"] = toks
        if not spec.encoder:
            arrays[f"logits_{k}"] = f32.run(toks)[0]
        for pooling in poolings:
            arrays[f"embd_{pooling}_{k}"] = f32.run(toks, embeddings=True, pooling=pooling)[1]
    f32.close()
    qpath = paths[spec.qtype]
    twin = tmp / (qpath.stem + "-twin.gguf")
    dequantized_twin(qpath, twin)
    tw, q = LlamaCpp(twin), LlamaCpp(qpath)
    for k, toks in enumerate(seqs):
        if spec.encoder:
            arrays[f"twin_embd_none_{k}"] = tw.run(toks, embeddings=True)[1]
            arrays[f"q_embd_none_{k}"] = q.run(toks, embeddings=True)[1]
        else:
            arrays[f"twin_logits_{k}"] = tw.run(toks)[0]
            arrays[f"q_top1_{k}"] = q.run(toks)[0].argmax(1).astype(np.int32)
    tw.close()
    q.close()
    twin.unlink()
    return arrays


def make_oracle(arch: str, out: Path = OUT) -> Path:
    paths = make_arch(arch, out)
    arrays = oracle_arrays(paths, ARCHS[arch], out)
    npz = out / f"{arch}.npz"
    np.savez_compressed(npz, **{k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()})
    return npz


# ---- tokenizers ------------------------------------------------------------------------------


def write_tokenizer_gguf(kind: str, out: Path = OUT) -> Path:
    """A vocabulary-only GGUF of the `kind` vocabulary."""
    from ggmlx import gguf
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tokenizer-{kind}.gguf"
    w = gguf.GGUFWriter()
    w.add_kv("general.architecture", "llama")
    w.add_kv("general.name", "tokenizer fixture")
    for k, v, vtype, atype in VOCABS[kind]():
        w.add_kv(k, v, vtype, atype)
    w.write(path)
    return path


def make_tokenizer_data(kind: str, out: Path = OUT) -> Path:
    """llama.cpp's tokenize (4 flag combinations) and detokenize of the corpus for a vocab."""
    import llama_cpp as L
    path = write_tokenizer_gguf(kind, out)
    quiet_llamacpp(L)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    rows = []
    for text in corpus_texts():
        raw = text.encode("utf-8", "surrogatepass")
        for add_special in (False, True):
            for parse_special in (False, True):
                buf = (L.llama_token * (4 * len(raw) + 8))()
                n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
                ids = [int(buf[i]) for i in range(n)]
                row = {"text": text, "add_special": add_special, "parse_special": parse_special, "ids": ids}
                if add_special and parse_special:
                    arr = (L.llama_token * max(len(ids), 1))(*ids)
                    dets = {}
                    for rm in (False, True):
                        for un in (False, True):
                            ob = (ctypes.c_char * (8 * len(raw) + 64))()
                            m = L.llama_detokenize(vocab, arr, len(ids), ob, len(ob), rm, un)
                            dets[f"{int(rm)}{int(un)}"] = bytes(ob[:m]).hex()
                    row["detokenize_hex"] = dets
                rows.append(row)
    L.llama_model_free(model)
    dst = out / f"tokenizer-{kind}.jsonl.gz"
    with gzip.GzipFile(dst, "wb", mtime=0) as fh:
        for row in rows:
            fh.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    return dst


# ---- the existing synthetic models -----------------------------------------------------------

SYNTHETIC = ROOT / "tests" / "data" / "synthetic"


def make_synthetic_companions() -> list[Path]:
    """`<stem>.llamacpp.npz` for each committed synthetic model: all-position logits of the
    24 reference tokens from the dequantized twin (exact path), the argmax of llama.cpp's
    own quantized run, and the twin's embeddings as a decoder embedder (pooling none, mean,
    last), by the same runner as the new fixtures."""
    written = []
    for gg in sorted(SYNTHETIC.glob("synth-*.gguf")):
        toks = np.load(gg.with_suffix(".npz"))["tokens"]
        twin = SYNTHETIC / (gg.stem + "-twin.gguf")
        dequantized_twin(gg, twin)
        tw, q = LlamaCpp(twin), LlamaCpp(gg)
        arrays = {"tokens": toks, "twin_logits": tw.run(toks)[0],
                  "q_top1": q.run(toks)[0].argmax(1).astype(np.int32)}
        for pooling in ("none", "mean", "last"):
            arrays[f"twin_embd_{pooling}"] = tw.run(toks, embeddings=True, pooling=pooling)[1]
        tw.close()
        q.close()
        twin.unlink()
        dst = gg.with_suffix(".llamacpp.npz")
        np.savez_compressed(dst, **arrays)
        written.append(dst)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("archs", nargs="*", help=f"architectures ({', '.join(ARCHS)}) or 'all'")
    ap.add_argument("--tokenizers", action="store_true", help="write the WPM / UGM / Gemma 4 tokenizer data")
    ap.add_argument("--synthetic", action="store_true", help="companions of tests/data/synthetic")
    ap.add_argument("--gguf-only", action="store_true", help="write the GGUFs, do not run llama.cpp")
    args = ap.parse_args(argv)
    archs = list(ARCHS) if args.archs == ["all"] else args.archs
    for arch in archs:
        if arch not in ARCHS:
            ap.error(f"unknown architecture '{arch}' (known: {', '.join(ARCHS)})")
        if args.gguf_only:
            print(make_arch(arch))
        else:
            print(make_oracle(arch))
    if args.tokenizers:
        for kind in ("wpm", "ugm", "gemma4"):
            print(make_tokenizer_data(kind))
    if args.synthetic:
        for p in make_synthetic_companions():
            print(p)


if __name__ == "__main__":
    main()
