"""One repeating block's weights (llama_layer) and the tensor declarations several
architectures share: the attention projections, a gated FFN, the mixture-of-experts FFN (with
the expert keys its shapes need), the LayerNorm block, the token embeddings and the output
head. An architecture's `load_tensors` (llm/models/<arch>.py) calls these and declares the
rest; architectures share declarations through this module, not through each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from ggmlx.tensor import Tensor
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.hparams import HParams
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


@dataclass
class Layer:
    """One repeating block's weights (llama_layer); absent tensors stay None."""
    attn_norm: Tensor | None = None
    wq: Tensor | None = None
    wk: Tensor | None = None
    wv: Tensor | None = None
    wqkv: Tensor | None = None
    wo: Tensor | None = None
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    bo: Tensor | None = None
    attn_q_norm: Tensor | None = None
    attn_k_norm: Tensor | None = None
    # multi-head latent attention (deepseek2): low-rank Q, the compressed KV and its per-head halves
    wq_a: Tensor | None = None
    wq_b: Tensor | None = None
    attn_q_a_norm: Tensor | None = None
    wkv_a_mqa: Tensor | None = None
    attn_kv_a_norm: Tensor | None = None
    wk_b: Tensor | None = None
    wv_b: Tensor | None = None
    attn_post_norm: Tensor | None = None
    ffn_norm: Tensor | None = None
    ffn_gate: Tensor | None = None
    ffn_up: Tensor | None = None
    ffn_down: Tensor | None = None
    ffn_post_norm: Tensor | None = None
    ffn_gate_inp: Tensor | None = None
    ffn_gate_exps: Tensor | None = None
    ffn_up_exps: Tensor | None = None
    ffn_down_exps: Tensor | None = None
    rope_freqs: Tensor | None = None
    # state-space (Mamba / Mamba-2) blocks
    ssm_in: Tensor | None = None
    ssm_conv1d: Tensor | None = None
    ssm_conv1d_b: Tensor | None = None
    ssm_x: Tensor | None = None
    ssm_dt: Tensor | None = None
    ssm_dt_b: Tensor | None = None
    ssm_a: Tensor | None = None
    ssm_d: Tensor | None = None
    ssm_norm: Tensor | None = None
    ssm_out: Tensor | None = None
    ssm_dt_norm: Tensor | None = None
    ssm_b_norm: Tensor | None = None
    ssm_c_norm: Tensor | None = None
    # Gated DeltaNet (qwen3next, qwen35): the output gate z's projection, beta and alpha (fused
    # in qwen3next's ssm_ba)
    wqkv_gate: Tensor | None = None
    ssm_beta: Tensor | None = None
    ssm_alpha: Tensor | None = None
    ssm_beta_alpha: Tensor | None = None
    # LFM2's short convolution: its kernel and the projections around it
    shortconv_conv: Tensor | None = None
    shortconv_in_proj: Tensor | None = None
    shortconv_out_proj: Tensor | None = None
    # biases and the extra norms of LayerNorm / encoder / shared-expert architectures
    attn_norm_b: Tensor | None = None
    bqkv: Tensor | None = None
    attn_out_norm: Tensor | None = None
    attn_out_norm_b: Tensor | None = None
    attn_sinks: Tensor | None = None
    ffn_norm_b: Tensor | None = None
    ffn_gate_b: Tensor | None = None
    ffn_up_b: Tensor | None = None
    ffn_down_b: Tensor | None = None
    layer_out_norm: Tensor | None = None
    layer_out_norm_b: Tensor | None = None
    ffn_gate_inp_shexp: Tensor | None = None
    ffn_gate_shexp: Tensor | None = None
    ffn_up_shexp: Tensor | None = None
    ffn_down_shexp: Tensor | None = None
    ffn_gate_inp_b: Tensor | None = None
    ffn_gate_exps_b: Tensor | None = None
    ffn_up_exps_b: Tensor | None = None
    ffn_down_exps_b: Tensor | None = None
    ffn_exp_probs_b: Tensor | None = None     # DeepSeek-V3-style expert selection bias
    # Gemma 3n: the per-layer input's gate, projection and norm; AltUp's router and
    # coefficients; Laurel's low-rank residual
    per_layer_inp_gate: Tensor | None = None
    per_layer_proj: Tensor | None = None
    per_layer_post_norm: Tensor | None = None
    altup_correct_coef: Tensor | None = None
    altup_correct_scale: Tensor | None = None
    altup_predict_coef: Tensor | None = None
    altup_router: Tensor | None = None
    altup_router_norm: Tensor | None = None
    laurel_l: Tensor | None = None
    laurel_r: Tensor | None = None
    laurel_post_norm: Tensor | None = None
    # Gemma 4: the layer scalar; the MoE block's router scale, second pre-norm, the post norms
    # of its dense and expert branches, fused gate+up experts, per-expert output scales
    out_scale: Tensor | None = None
    ffn_gate_inp_s: Tensor | None = None
    ffn_pre_norm_2: Tensor | None = None
    ffn_post_norm_1: Tensor | None = None
    ffn_post_norm_2: Tensor | None = None
    ffn_gate_up_exps: Tensor | None = None
    ffn_down_exps_s: Tensor | None = None


def create_attn(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """The tensors every attention block has: attn_norm, wq, wk, wv, wo."""
    n_embd, n_head = hp.n_embd, hp.n_head(il)
    layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
    layer.wq = ml.create_tensor(tn(T.ATTN_Q, "weight", il), (n_embd, hp.n_embd_head_k * n_head), dev)
    layer.wk = ml.create_tensor(tn(T.ATTN_K, "weight", il), (n_embd, hp.n_embd_k_gqa(il)), dev)
    layer.wv = ml.create_tensor(tn(T.ATTN_V, "weight", il), (n_embd, hp.n_embd_v_gqa(il)), dev)
    layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (hp.n_embd_head_v * n_head, n_embd), dev)


def create_mamba2(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device, *,
                  conv_bias: TensorFlag = TensorFlag.NONE, norm: TensorFlag = TensorFlag.NONE) -> None:
    """A Mamba-2 block's tensors (mamba2, and the SSM layers of the hybrids): the input
    projection to z, x, B, C and dt, the conv over x, B, C (its bias optional where
    `conv_bias` says so), the per-head A, D and dt bias, the grouped norm (optional where
    `norm` says so: falcon-h1) and the output projection."""
    d_inner, d_state, n_group, n_head = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    conv_dim = d_inner + 2 * n_group * d_state
    layer.ssm_in = ml.create_tensor(tn(T.SSM_IN, "weight", il), (hp.n_embd, d_inner + conv_dim + n_head), dev)
    layer.ssm_conv1d = ml.create_tensor(tn(T.SSM_CONV1D, "weight", il), (hp.ssm_d_conv, conv_dim), dev)
    layer.ssm_conv1d_b = ml.create_tensor(tn(T.SSM_CONV1D, "bias", il), (conv_dim,), dev, conv_bias)
    layer.ssm_dt_b = ml.create_tensor(tn(T.SSM_DT, "bias", il), (n_head,), dev)
    layer.ssm_a = ml.create_tensor(tn(T.SSM_A, None, il), (1, n_head), dev)       # no "weight" suffix
    layer.ssm_d = ml.create_tensor(tn(T.SSM_D, None, il), (1, n_head), dev)
    layer.ssm_norm = ml.create_tensor(tn(T.SSM_NORM, "weight", il), (d_inner // n_group, n_group), dev, norm)
    layer.ssm_out = ml.create_tensor(tn(T.SSM_OUT, "weight", il), (d_inner, hp.n_embd), dev)


def create_qkv(layer: Layer, ml: ModelLoader, il: int, dev: jax.Device, n_embd: int, n_q: int, n_k: int,
               n_v: int) -> None:
    """Q, K, V projections as llama.cpp's create_tensor_qkv: a fused attn_qkv with an
    optional fused bias, or separate attn_q/k/v, each with an optional bias. (llama.cpp also
    accepts separate biases next to a fused weight; such a file is rejected here, naming
    the unclaimed bias tensor.)"""
    opt = TensorFlag.NOT_REQUIRED
    layer.wqkv = ml.create_tensor(tn(T.ATTN_QKV, "weight", il), (n_embd, n_q + n_k + n_v), dev, opt)
    if layer.wqkv is not None:
        layer.bqkv = ml.create_tensor(tn(T.ATTN_QKV, "bias", il), (n_q + n_k + n_v,), dev, opt)
        return
    layer.wq = ml.create_tensor(tn(T.ATTN_Q, "weight", il), (n_embd, n_q), dev)
    layer.wk = ml.create_tensor(tn(T.ATTN_K, "weight", il), (n_embd, n_k), dev)
    layer.wv = ml.create_tensor(tn(T.ATTN_V, "weight", il), (n_embd, n_v), dev)
    layer.bq = ml.create_tensor(tn(T.ATTN_Q, "bias", il), (n_q,), dev, opt)
    layer.bk = ml.create_tensor(tn(T.ATTN_K, "bias", il), (n_k,), dev, opt)
    layer.bv = ml.create_tensor(tn(T.ATTN_V, "bias", il), (n_v,), dev, opt)


def create_ffn(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """A gated FFN: ffn_norm, ffn_gate, ffn_up, ffn_down."""
    n_embd, n_ff = hp.n_embd, hp.n_ff(il)
    layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
    layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
    layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
    layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)


def load_moe_hparams(hp: HParams, ml: GGUFMeta) -> None:
    """The expert keys of the MoE architectures (qwen2moe, qwen3moe, gpt-oss), with llama.cpp's
    load-time checks; an architecture's load_hparams calls it before create_experts needs them."""
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer, [0] * hp.n_layer)[0]
    if hp.n_expert == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' must be > 0 for {ml.arch_name}")
    if hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be > 0 for {ml.arch_name}")


def create_experts(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """ffn_norm, the router and the stacked expert matrices [n_embd, n_ff_exp, n_expert]; an
    expert is n_ff / n_expert_used wide when the file does not say."""
    n_embd, n_exp = hp.n_embd, hp.n_expert
    n_ff = hp.n_ff_exp if hp.n_ff_exp else hp.n_ff(il) // hp.n_expert_used
    layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
    layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
    layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
    layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
    layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)


def create_ln_block(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device, *,
                    ffn_norm: bool) -> None:
    """LayerNorm blocks (starcoder2, gpt2, phi2): attn_norm(+b), Q/K/V, wo + bias, ffn_norm(+b)
    when the FFN has its own norm, and a sequential FFN with biases."""
    n_embd, n_ff = hp.n_embd, hp.n_ff(il)
    layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
    layer.attn_norm_b = ml.create_tensor(tn(T.ATTN_NORM, "bias", il), (n_embd,), dev)
    create_qkv(layer, ml, il, dev, n_embd, n_embd, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
    layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
    layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev)
    if ffn_norm:
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_norm_b = ml.create_tensor(tn(T.FFN_NORM, "bias", il), (n_embd,), dev)
    layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
    layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev)
    layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
    layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev)


def create_embd_output(model: Model, ml: ModelLoader) -> None:
    """token_embd on the input device, then the output norm and projection."""
    hp = model.hparams
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (hp.n_embd, hp.n_vocab),
                                      model.place.dev_input)
    create_output(model, ml, hp.n_embd, hp.n_vocab)


def create_output(model: Model, ml: ModelLoader, n_embd: int, n_vocab: int, *,
                  norm: T = T.OUTPUT_NORM) -> None:
    """Output norm (`norm`: LFM2 names it token_embd_norm) and projection; a model without
    output.weight ties it to token_embd (loaded again on the output device when that
    differs, like TENSOR_DUPLICATED)."""
    dev = model.place.dev_output
    model.output_norm = ml.create_tensor(tn(norm, "weight"), (n_embd,), dev)
    model.output = ml.create_tensor(tn(T.OUTPUT, "weight"), (n_embd, n_vocab), dev,
                                    TensorFlag.NOT_REQUIRED)
    if model.output is None:
        if dev == model.place.dev_input:
            model.output = model.tok_embd
        else:
            model.output = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (n_embd, n_vocab), dev,
                                            TensorFlag.DUPLICATED)


def create_ln_output(model: Model, ml: ModelLoader) -> None:
    """token_embd, output_norm with bias, output (tied to token_embd when absent)."""
    create_embd_output(model, ml)
    model.output_norm_b = ml.create_tensor(tn(T.OUTPUT_NORM, "bias"), (model.hparams.n_embd,),
                                           model.place.dev_output)
