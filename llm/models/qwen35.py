"""Qwen3.5 / Qwen3.6 (dense): llama.cpp's src/models/qwen35.cpp.

Three of every four layers are Gated DeltaNet linear attention (delta_net_base.py): one
projection to q, k, v (through a short causal conv and silu, q and k L2-normed), beta and
the decay gate per value head, the delta rule over each sequence's [S_v, S_v] state per head,
the output RMS-normed and gated by silu(z). The others are full attention with a sigmoid
output gate carried in the query projection ([q; gate] per head), RMS-normed q and k, and
Qwen3-VL's interleaved M-RoPE. Every block is post-normed Qwen style (attn_norm before the
mixer, post_attention_norm before the FFN). The file's last `nextn_predict_layers` blocks are
the multi-token-prediction head, loaded by llama.cpp only for MTP drafting and skipped here."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, InpAttnKV, InpRS, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader
from llm.models.delta_net_base import build_conv_state, build_gdn_l2_norm, build_norm_gated, build_recurrent_attn
from llm.models.qwen2vl import load_mrope_sections

if TYPE_CHECKING:
    from collections.abc import Callable

    import jax

    from ggmlx.tensor import Tensor
    from llm.model import Model


def load_delta_net_hparams(hp: HParams, ml: GGUFMeta) -> None:
    """The keys every Gated DeltaNet hybrid reads (qwen3next, qwen35, qwen35moe): the MTP
    blocks left out of the trunk, the SSM sizes, which layers are recurrent (an explicit
    per-layer array, else every layer but each `full_attention_interval`-th, 4 by default)."""
    n_layer_all = hp.n_layer
    hp.drop_nextn_layers(ml.get_key(LLMKV.NEXTN_PREDICT_LAYERS, int, 0))
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_n_group = ml.get_key(LLMKV.SSM_GROUP_COUNT, int)
    interval = ml.get_key(LLMKV.FULL_ATTENTION_INTERVAL, int, 4)
    if interval < 1:
        raise ml.error(f"'{ml.key_name(LLMKV.FULL_ATTENTION_INTERVAL)}' = {interval} must be >= 1")
    default = [(il + 1) % interval != 0 for il in range(n_layer_all)]
    recurrent = ml.get_key_or_arr(LLMKV.ATTENTION_RECURRENT_LAYERS, bool, n_layer_all, default)
    hp.recurrent_layers = [bool(r) for r in recurrent[:hp.n_layer]]
    names = {k: ml.key_name(k) for k in (LLMKV.SSM_CONV_KERNEL, LLMKV.SSM_INNER_SIZE, LLMKV.SSM_STATE_SIZE,
                                          LLMKV.SSM_TIME_STEP_RANK, LLMKV.SSM_GROUP_COUNT)}
    if hp.ssm_d_conv < 2 or min(hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank, hp.ssm_n_group) < 1:
        raise ml.error(f"{', '.join(repr(n) for n in names.values())} = {hp.ssm_d_conv}, {hp.ssm_d_inner}, "
                       f"{hp.ssm_d_state}, {hp.ssm_dt_rank}, {hp.ssm_n_group}: the kernel must be >= 2 and "
                       "the sizes >= 1")
    if hp.ssm_d_inner != hp.ssm_d_state * hp.ssm_dt_rank or hp.ssm_dt_rank % hp.ssm_n_group:
        raise ml.error(f"'{names[LLMKV.SSM_INNER_SIZE]}' = {hp.ssm_d_inner} must be the state size "
                       f"{hp.ssm_d_state} x the value heads {hp.ssm_dt_rank} ('{names[LLMKV.SSM_TIME_STEP_RANK]}'), "
                       f"whose count the key heads {hp.ssm_n_group} ('{names[LLMKV.SSM_GROUP_COUNT]}') divide")
    if hp.n_embd_head_k != hp.n_embd_head_v:
        raise ml.error(f"key and value heads differ ({hp.n_embd_head_k} vs {hp.n_embd_head_v}): the gated "
                       "attention needs them equal")


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.IMROPE
    load_delta_net_hparams(hp, ml)
    load_mrope_sections(hp, ml)


def create_trunk_mixer(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """attn_norm and post_attention_norm, and either the gated full attention (the query
    projection twice as wide: a gate per query element) or the linear attention's tensors."""
    n_embd = hp.n_embd
    layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
    layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
    if not hp.is_recurrent(il):
        n_q = hp.n_embd_head_k * hp.n_head(il)
        create_qkv(layer, ml, il, dev, n_embd, 2 * n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        return
    key_dim, value_dim = hp.ssm_d_state * hp.ssm_n_group, hp.ssm_d_inner
    n_v_heads = hp.ssm_dt_rank
    layer.ssm_conv1d = ml.create_tensor(tn(T.SSM_CONV1D, "weight", il), (hp.ssm_d_conv, 2 * key_dim + value_dim), dev)
    layer.ssm_dt_b = ml.create_tensor(tn(T.SSM_DT, "bias", il), (n_v_heads,), dev)
    layer.ssm_a = ml.create_tensor(tn(T.SSM_A, None, il), (n_v_heads,), dev)     # no "weight" suffix
    layer.ssm_norm = ml.create_tensor(tn(T.SSM_NORM, "weight", il), (hp.ssm_d_state,), dev)
    layer.ssm_out = ml.create_tensor(tn(T.SSM_OUT, "weight", il), (value_dim, n_embd), dev)


def create_delta_net_projections(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """Qwen3.5's separate projections: q, k, v together (attn_qkv), the gate z (attn_gate),
    beta and alpha."""
    key_dim, value_dim, n_embd = hp.ssm_d_state * hp.ssm_n_group, hp.ssm_d_inner, hp.n_embd
    layer.wqkv = ml.create_tensor(tn(T.ATTN_QKV, "weight", il), (n_embd, 2 * key_dim + value_dim), dev)
    layer.wqkv_gate = ml.create_tensor(tn(T.ATTN_GATE, "weight", il), (n_embd, value_dim), dev)
    layer.ssm_beta = ml.create_tensor(tn(T.SSM_BETA, "weight", il), (n_embd, hp.ssm_dt_rank), dev)
    layer.ssm_alpha = ml.create_tensor(tn(T.SSM_ALPHA, "weight", il), (n_embd, hp.ssm_dt_rank), dev)


def skip_mtp_layers(hp: HParams, ml: ModelLoader) -> None:
    for il in range(hp.n_layer, hp.n_layer + hp.n_layer_nextn):
        ml.skip_tensors(f"blk.{il}.")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_trunk_mixer(layer, ml, hp, il, dev)
        if hp.is_recurrent(il):
            create_delta_net_projections(layer, ml, hp, il, dev)
        n_ff = hp.n_ff(il)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (hp.n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, hp.n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (hp.n_embd, n_ff), dev)
        model.layers.append(layer)
    skip_mtp_layers(hp, ml)


def _proj(g: GraphBuilder, w: Tensor | None, b: Tensor | None, cur: Tensor, what: str, il: int) -> Tensor:
    t = g.build_lora_mm(g.need(w, what, il), cur)
    return t if b is None else ops.add(t, b)


def build_gated_qkv(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor]:
    """llama.cpp's build_qkv without the reshape: Qcur_full [2 n_q, n_tokens] (query and gate
    per head), Kcur and Vcur [n_k, n_tokens], from a fused attn_qkv or separate q, k, v."""
    hp = g.hparams
    n_q2 = 2 * hp.n_embd_head_k * hp.n_head(il)
    n_k, n_v = hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
    if layer.wqkv is not None:
        qkv = g.cb(_proj(g, layer.wqkv, layer.bqkv, cur, "attn_qkv", il), "wqkv", il)
        rs, esz = qkv.nb[1], qkv.nb[0]
        q = ops.cont(ops.view_2d(qkv, n_q2, g.n_tokens, rs, 0))
        k = ops.cont(ops.view_2d(qkv, n_k, g.n_tokens, rs, n_q2 * esz))
        v = ops.cont(ops.view_2d(qkv, n_v, g.n_tokens, rs, (n_q2 + n_k) * esz))
        return q, k, v
    return (_proj(g, layer.wq, layer.bq, cur, "attn_q", il), _proj(g, layer.wk, layer.bk, cur, "attn_k", il),
            _proj(g, layer.wv, layer.bv, cur, "attn_v", il))


def build_layer_attn(g: GraphBuilder, inp: InpAttnKV, cur: Tensor, inp_pos: Tensor, layer: Layer, il: int, *,
                     rope_multi: bool = True) -> Tensor:
    """Full attention whose output is gated by sigmoid(gate), the gate read from the second
    half of each query head's projection; M-RoPE (qwen35) or NEOX rope (qwen3next)."""
    hp = g.hparams
    d, n_head, n_head_kv = hp.n_embd_head_k, hp.n_head(il), hp.n_head_kv(il)
    q_full, k, v = build_gated_qkv(g, layer, cur, il)
    g.cb(q_full, "Qcur_full", il)
    g.cb(k, "Kcur", il)
    g.cb(v, "Vcur", il)
    esz = q_full.nb[0]
    q = g.cb(ops.view_3d(q_full, d, n_head, g.n_tokens, 2 * d * esz, 2 * d * n_head * esz, 0), "Qcur_reshaped", il)
    q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
    k = ops.reshape_3d(k, d, n_head_kv, g.n_tokens)
    k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
    gate = ops.view_3d(q_full, d, n_head, g.n_tokens, 2 * d * esz, 2 * d * n_head * esz, d * esz)
    gate = g.cb(ops.cont_2d(gate, d * n_head, g.n_tokens), "gate_reshaped", il)
    v = ops.reshape_3d(v, d, n_head_kv, g.n_tokens)
    if rope_multi:
        q = ops.rope_multi(q, inp_pos, None, **g.rope_multi_params(il))
        k = ops.rope_multi(k, inp_pos, None, **g.rope_multi_params(il))
    else:
        q = ops.rope_ext(q, inp_pos, None, **g.rope_params(il))
        k = ops.rope_ext(k, inp_pos, None, **g.rope_params(il))
    g.cb(q, "Qcur", il)
    g.cb(k, "Kcur", il)
    g.cb(v, "Vcur", il)
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(d)
    cur = g.cb(g.build_attn(inp, None, None, q, k, v, kq_scale, il), "attn_pregate", il)
    gate = g.cb(ops.sigmoid(gate), "gate_sigmoid", il)
    cur = g.cb(ops.mul(cur, gate), "attn_gated", il)
    return g.cb(g.build_lora_mm(g.need(layer.wo, "attn_output", il), cur), "attn_output", il)


def build_layer_attn_linear(g: GraphBuilder, inp: InpRS, cur: Tensor, layer: Layer, il: int, *,
                            qkv_mixed: Tensor, z: Tensor, beta: Tensor, alpha: Tensor,
                            repeat_heads: Callable[[Tensor, int], Tensor] | None = None) -> Tensor:
    """The Gated DeltaNet mixer from its projections: qkv_mixed [conv channels, n_seq_tokens,
    n_seqs], z [value_dim, n_tokens], beta [1, H_v, n_seq_tokens, n_seqs] (pre-sigmoid),
    alpha [H_v, n_seq_tokens, n_seqs]. The conv runs over each sequence's conv state, the
    decay gate is softplus(alpha + dt_bias) * A (A = -exp(A_log), as stored), and the key
    heads tile over the value heads inside the op, or are first spread over them by
    `repeat_heads(x, H_v)` (qwen3next's interleaved order). -> `linear_attn_out` [n_embd,
    n_tokens]."""
    hp, rs = g.hparams, g.rs
    assert rs is not None       # build_rs_inp checked
    conv_all, s_all = rs.r_l[il], rs.s_l[il]
    assert conv_all is not None and s_all is not None     # the memory holds every recurrent layer
    S, H_k, H_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    n_seqs = g.params.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    beta = g.cb(ops.sigmoid(beta), "beta_sigmoid", il)
    alpha_sp = g.cb(ops.softplus(ops.add(alpha, g.need(layer.ssm_dt_b, "ssm_dt", il))), "a_softplus", il)
    gate = g.cb(ops.mul(alpha_sp, g.need(layer.ssm_a, "ssm_a", il)), "gate", il)
    gate = ops.reshape_4d(gate, 1, H_v, n_seq_tokens, n_seqs)
    conv_kernel = g.need(layer.ssm_conv1d, "ssm_conv1d", il)
    channels = hp.ssm_d_inner + 2 * H_k * S
    conv_input = build_conv_state(g, inp, conv_all, qkv_mixed, conv_kernel.ne[0], channels, il)
    state = ops.reshape_4d(g.build_rs(inp, s_all, hp.n_embd_s()), S, S, H_v, n_seqs)
    g.cb(state, "state_predelta", il)
    conv_out = g.cb(ops.ssm_conv(conv_input, conv_kernel), "conv_output_raw", il)
    conv_out = g.cb(ops.silu(conv_out), "conv_output_silu", il)
    f32 = 4
    nb1 = channels * f32
    q = g.cb(ops.view_4d(conv_out, S, H_k, n_seq_tokens, n_seqs, S * f32, nb1, nb1 * n_seq_tokens, 0), "q_conv", il)
    k = g.cb(ops.view_4d(conv_out, S, H_k, n_seq_tokens, n_seqs, S * f32, nb1, nb1 * n_seq_tokens,
                         S * H_k * f32), "k_conv", il)
    v = g.cb(ops.view_4d(conv_out, S, H_v, n_seq_tokens, n_seqs, S * f32, nb1, nb1 * n_seq_tokens,
                         2 * S * H_k * f32), "v_conv", il)
    q = build_gdn_l2_norm(q, hp.f_norm_rms_eps)
    k = build_gdn_l2_norm(k, hp.f_norm_rms_eps)
    if repeat_heads is not None:
        q, k = repeat_heads(q, H_v), repeat_heads(k, H_v)
    g.cb(q, "q_conv_predelta", il)
    g.cb(k, "k_conv_predelta", il)
    g.cb(v, "v_conv_predelta", il)
    out = build_recurrent_attn(g, inp, s_all, q, k, v, gate, beta, state, il)
    z = ops.reshape_4d(z, S, H_v, n_seq_tokens, n_seqs)
    out = build_norm_gated(g, out, g.need(layer.ssm_norm, "ssm_norm", il), z, il)
    out = g.cb(ops.reshape_3d(out, S * H_v, n_seq_tokens, n_seqs), "final_output", il)
    cur = g.cb(g.build_lora_mm(g.need(layer.ssm_out, "ssm_out", il), out), "linear_attn_out", il)
    return ops.reshape_2d(cur, hp.n_embd, n_seq_tokens * n_seqs)


def build_qkvz(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3.5's projections: qkv_mixed, z, beta and alpha, shaped for the mixer."""
    hp = g.hparams
    n_seqs = g.params.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    qkv = g.build_lora_mm(g.need(layer.wqkv, "attn_qkv", il), cur)
    qkv = g.cb(ops.reshape_3d(qkv, qkv.ne[0], n_seq_tokens, n_seqs), "linear_attn_qkv_mixed", il)
    z = g.cb(g.build_lora_mm(g.need(layer.wqkv_gate, "attn_gate", il), cur), "z", il)
    beta = g.build_lora_mm(g.need(layer.ssm_beta, "ssm_beta", il), cur)
    beta = g.cb(ops.reshape_4d(beta, 1, hp.ssm_dt_rank, n_seq_tokens, n_seqs), "beta", il)
    alpha = g.build_lora_mm(g.need(layer.ssm_alpha, "ssm_alpha", il), cur)
    alpha = g.cb(ops.reshape_3d(alpha, hp.ssm_dt_rank, n_seq_tokens, n_seqs), "alpha", il)
    return qkv, z, beta, alpha


def build_graph(g: GraphBuilder) -> None:
    build_trunk(g, build_dense_ffn)


def build_trunk(g: GraphBuilder, ffn: Callable[[GraphBuilder, Tensor, Layer, int], Tensor]) -> None:
    """The layers and the output; `ffn` is the block's FFN (qwen35moe's experts)."""
    m, hp = g.model, g.hparams
    inpL = g.cb(g.build_inp_embd(m.tok_embd), "model.input_embed")
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_pos = g.build_inp_pos()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        if hp.is_recurrent(il):
            qkv, z, beta, alpha = build_qkvz(g, layer, cur, il)
            cur = build_layer_attn_linear(g, inp_rs, cur, layer, il, qkv_mixed=qkv, z=z, beta=beta, alpha=alpha)
        else:
            cur = build_layer_attn(g, inp_attn, cur, inp_pos, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        cur = g.cb(ops.add(cur, inpSA), "attn_residual", il)
        ffn_residual = cur
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        cur = g.cb(ffn(g, cur, layer, il), "ffn_out", il)
        cur = g.cb(ops.add(cur, ffn_residual), "post_ffn", il)
        inpL = g.cb(cur, "l_out", il)

    g.build_output(inpL)


def build_dense_ffn(g: GraphBuilder, cur: Tensor, layer: Layer, il: int) -> Tensor:
    return g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                       LLMFfnGateType.PAR, il)

