"""Qwen3-Next (80B-A3B): llama.cpp's src/models/qwen3next.cpp.

The first Gated DeltaNet hybrid of the Qwen family, Qwen3.5's ancestor (qwen35.py holds the
shared pieces): three linear-attention layers to one gated full attention, NEOX rope, an MoE
FFN with a sigmoid-gated shared expert in every layer. Its GGUFs carry the linear attention's
input projection fused per key head ([q, k, v, z] in ssm_in, [beta, alpha] in ssm_ba; newer
conversions split q, k, v and z as Qwen3.5 does), and each key head serves a run of
consecutive value heads, so q and k are repeat-interleaved before the delta rule."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMTensor as T
from llm.arch import tn
from llm.graph import GraphBuilder, InpAttnKV, InpRS, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag
from llm.models import qwen35, qwen35moe

if TYPE_CHECKING:
    from ggmlx.tensor import Tensor
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    qwen35.load_delta_net_hparams(hp, ml)
    qwen35moe.load_moe_hparams(hp, ml)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    opt = TensorFlag.NOT_REQUIRED
    create_embd_output(model, ml)
    key_dim, value_dim, n_embd = hp.ssm_d_state * hp.ssm_n_group, hp.ssm_d_inner, hp.n_embd
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        qwen35.create_trunk_mixer(layer, ml, hp, il, dev)
        if hp.is_recurrent(il):
            layer.ssm_in = ml.create_tensor(tn(T.SSM_IN, "weight", il), (n_embd, 2 * key_dim + 2 * value_dim), dev, opt)
            if layer.ssm_in is None:
                layer.wqkv = ml.create_tensor(tn(T.ATTN_QKV, "weight", il), (n_embd, 2 * key_dim + value_dim), dev)
                layer.wqkv_gate = ml.create_tensor(tn(T.ATTN_GATE, "weight", il), (n_embd, value_dim), dev)
            n_ba = 2 * hp.ssm_dt_rank
            layer.ssm_beta_alpha = ml.create_tensor(tn(T.SSM_BETA_ALPHA, "weight", il), (n_embd, n_ba), dev)
        qwen35moe.create_moe(layer, ml, hp, il, dev)
        model.layers.append(layer)
    qwen35.skip_mtp_layers(hp, ml)


def build_layer_attn(g: GraphBuilder, inp: InpAttnKV, cur: Tensor, inp_pos: Tensor, layer: Layer, il: int) -> Tensor:
    """Full attention gated by sigmoid(gate), the gate the second half of each query head."""
    hp = g.hparams
    d, n_head, n_head_kv = hp.n_embd_head_k, hp.n_head(il), hp.n_head_kv(il)
    q_full, k, v = qwen35.build_gated_qkv(g, layer, cur, il)
    g.cb(q_full, "Qcur_full", il)
    g.cb(k, "Kcur", il)
    g.cb(v, "Vcur", il)
    q_full = ops.reshape_4d(q_full, 2 * d, n_head, g.n_tokens, 1)
    nb = q_full.nb
    q = g.cb(ops.view_4d(q_full, d, n_head, g.n_tokens, 1, nb[1], nb[2], nb[3], 0), "Qcur_view", il)
    gate = g.cb(ops.view_4d(q_full, d, n_head, g.n_tokens, 1, nb[1], nb[2], nb[3], d * nb[0]), "gate", il)
    k = ops.reshape_3d(k, d, n_head_kv, g.n_tokens)
    v = ops.reshape_3d(v, d, n_head_kv, g.n_tokens)
    q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
    k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
    q = g.cb(ops.rope_ext(ops.reshape_3d(q, d, n_head, g.n_tokens), inp_pos, None, **g.rope_params(il)), "Qcur", il)
    k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
    g.cb(v, "Vcur", il)
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else d ** -0.5
    cur = g.cb(g.build_attn(inp, None, None, q, k, v, kq_scale, il), "attn_pregate", il)
    gate = g.cb(ops.sigmoid(ops.cont_2d(gate, d * n_head, g.n_tokens)), "gate_sigmoid", il)
    cur = g.cb(ops.mul(cur, gate), "attn_gated", il)
    return g.cb(g.build_lora_mm(g.need(layer.wo, "attn_output", il), cur), "attn_output", il)


def build_qkvz(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """qkv_mixed [conv channels, n_seq_tokens, n_seqs] and z [value_dim, n_tokens]: from
    attn_qkv and attn_gate, or split out of the legacy ssm_in, whose rows hold per key head its
    q, k, then the v and z of the value heads it serves."""
    hp = g.hparams
    n_seqs = g.params.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    S, H_k, H_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    if layer.ssm_in is None:
        qkv = g.build_lora_mm(g.need(layer.wqkv, "attn_qkv", il), cur)
        qkv = g.cb(ops.reshape_3d(qkv, qkv.ne[0], n_seq_tokens, n_seqs), "linear_attn_qkv_mixed", il)
        return qkv, g.cb(g.build_lora_mm(g.need(layer.wqkv_gate, "attn_gate", il), cur), "z", il)
    mixed = g.cb(g.build_lora_mm(layer.ssm_in, cur), "linear_attn_mixed_qkvz", il)
    vz = S * H_v // H_k
    mixed = ops.reshape_4d(mixed, 2 * S + 2 * vz, H_k, n_seq_tokens, n_seqs)
    nb, esz = mixed.nb, mixed.nb[0]
    q = g.cb(ops.view_4d(mixed, S, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], 0), "q", il)
    k = g.cb(ops.view_4d(mixed, S, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], S * esz), "k", il)
    v = g.cb(ops.view_4d(mixed, vz, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], 2 * S * esz), "v", il)
    z = ops.view_4d(mixed, vz, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], (2 * S + vz) * esz)
    z = g.cb(ops.cont(z), "z", il)
    q = g.cb(ops.cont(ops.reshape_3d(ops.cont(q), S * H_k, n_seq_tokens, n_seqs)), "query_flat", il)
    k = g.cb(ops.cont(ops.reshape_3d(ops.cont(k), S * H_k, n_seq_tokens, n_seqs)), "key_flat", il)
    v = g.cb(ops.cont(ops.reshape_3d(ops.cont(v), S * H_v, n_seq_tokens, n_seqs)), "value_flat", il)
    qkv = g.cb(ops.concat(ops.concat(q, k, 0), v, 0), "qkv_mixed", il)
    return qkv, ops.reshape_2d(z, S * H_v, n_seq_tokens * n_seqs)


def build_ba(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """beta [1, H_v, n_seq_tokens, n_seqs] (pre-sigmoid) and alpha [H_v, n_seq_tokens, n_seqs]
    from ssm_ba, whose rows hold per key head the betas, then the alphas, of its value heads."""
    hp = g.hparams
    n_seqs = g.params.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    H_k, H_v = hp.ssm_n_group, hp.ssm_dt_rank
    r = H_v // H_k
    ba = g.cb(g.build_lora_mm(g.need(layer.ssm_beta_alpha, "ssm_ba", il), cur), "linear_attn_mixed_ba", il)
    ba = ops.reshape_4d(ba, 2 * r, H_k, n_seq_tokens, n_seqs)
    nb = ba.nb
    b = g.cb(ops.view_4d(ba, r, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], 0), "b", il)
    a = g.cb(ops.view_4d(ba, r, H_k, n_seq_tokens, n_seqs, nb[1], nb[2], nb[3], r * nb[0]), "a", il)
    beta = ops.reshape_4d(ops.cont(b), 1, H_v, n_seq_tokens, n_seqs)
    alpha = ops.reshape_3d(ops.cont(a), H_v, n_seq_tokens, n_seqs)
    return beta, alpha


def repeat_interleave_heads(q: Tensor, H_v: int) -> Tensor:
    """[S, H_k, T, n_seqs] -> [S, H_v, T, n_seqs] with key head h serving value heads
    h * r .. h * r + r - 1 (r = H_v / H_k)."""
    S, H_k, T, n_seqs = q.ne
    q = ops.reshape_4d(q, S, 1, H_k, T * n_seqs)
    q = ops.repeat_4d(q, S, H_v // H_k, H_k, T * n_seqs)
    return ops.reshape_4d(q, S, H_v, T, n_seqs)


def build_layer_attn_linear(g: GraphBuilder, inp: InpRS, cur: Tensor, layer: Layer, il: int) -> Tensor:
    hp = g.hparams
    qkv, z = build_qkvz(g, layer, cur, il)
    beta, alpha = build_ba(g, layer, cur, il)
    heads = None if hp.ssm_n_group == hp.ssm_dt_rank else repeat_interleave_heads
    return qwen35.build_layer_attn_linear(g, inp, cur, layer, il, qkv_mixed=qkv, z=z, beta=beta, alpha=alpha,
                                          repeat_heads=heads)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.cb(g.build_inp_embd(m.tok_embd), "model.embed_tokens")
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_pos = g.build_inp_pos()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = build_layer_attn_linear(g, inp_rs, cur, layer, il)
        else:
            cur = build_layer_attn(g, inp_attn, cur, inp_pos, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        cur = g.cb(ops.add(cur, inpSA), "attn_residual", il)
        ffn_residual = cur
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        cur = g.cb(qwen35moe.build_moe_ffn(g, cur, layer, il), "ffn_out", il)
        cur = g.cb(ops.add(cur, ffn_residual), "post_moe", il)
        inpL = g.cb(cur, "l_out", il)

    g.build_output(inpL)
