"""DeepSeek-V2 / V3 / R1, Kimi-K2 (deepseek2): llama.cpp's src/models/deepseek2.cpp.

Multi-head latent attention (MLA) with the absorption llama.cpp uses: each token's KV is
compressed to a latent of kv_lora_rank values plus a shared roped key part, and that latent is
all the cache holds (one KV head of kv_lora_rank + n_rot values, V a view of its first
kv_lora_rank; per-head K/V are never stored). Queries go through a low-rank wq_a -> norm ->
wq_b (or wq for the lite models); their no-rope halves are absorbed into the latent space by
wk_b, and the attention output is decompressed per head by wv_b (GraphBuilder.build_attn_mla).
FFN: `leading_dense_block_count` dense layers, then routed experts (softmax or sigmoid gating,
a selection bias, DeepSeek-V3's group-limited routing, renormalized and scaled weights) plus
shared experts. The legacy unsplit wkv_b is refused by name."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops, types
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_layer_dense_lead = ml.get_key(LLMKV.LEADING_DENSE_BLOCK_COUNT, int, 0)
    hp.n_lora_q = ml.get_key(LLMKV.ATTENTION_Q_LORA_RANK, int, 0)          # 0: the lite models' plain wq
    hp.n_lora_kv = ml.get_key(LLMKV.ATTENTION_KV_LORA_RANK, int)
    hp.n_embd_head_k_mla = ml.get_key(LLMKV.ATTENTION_KEY_LENGTH_MLA, int, 0)
    hp.n_embd_head_v_mla = ml.get_key(LLMKV.ATTENTION_VALUE_LENGTH_MLA, int, 0)
    if not hp.is_mla:
        raise ml.error(f"no '{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH_MLA)}': a legacy file with the unsplit "
                       "attn_kv_b (MHA without the absorption) is not supported; convert it again")
    if hp.n_head_kv(0) != 1 or hp.n_embd_head_k != hp.n_lora_kv + hp.n_rot:
        raise ml.error(f"MLA needs one KV head of kv_lora_rank + n_rot = {hp.n_lora_kv + hp.n_rot} values, got "
                       f"{hp.n_head_kv(0)} heads of '{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH)}' = {hp.n_embd_head_k}")
    if hp.n_embd_head_k_mla <= hp.n_rot:
        raise ml.error(f"'{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH_MLA)}' = {hp.n_embd_head_k_mla} must exceed "
                       f"the rope part {hp.n_rot}")
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.n_expert_shared = ml.get_key(LLMKV.EXPERT_SHARED_COUNT, int)
    hp.expert_weights_scale = ml.get_key(LLMKV.EXPERT_WEIGHTS_SCALE, float, 0.0)
    hp.expert_weights_norm = ml.get_key(LLMKV.EXPERT_WEIGHTS_NORM, bool, False)
    gating = ml.get_key(LLMKV.EXPERT_GATING_FUNC, int, int(ExpertGatingFuncType.NONE))
    hp.expert_gating_func = int(ExpertGatingFuncType.SOFTMAX) if gating == ExpertGatingFuncType.NONE else gating
    hp.n_expert_groups = ml.get_key(LLMKV.EXPERT_GROUP_COUNT, int, 0)
    hp.n_group_used = ml.get_key(LLMKV.EXPERT_GROUP_USED_COUNT, int, 0)
    if hp.n_expert_groups > 1 and not (hp.n_expert % hp.n_expert_groups == 0
                                       and 0 < hp.n_group_used < hp.n_expert_groups):
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_GROUP_COUNT)}' = {hp.n_expert_groups} must divide the "
                       f"{hp.n_expert} experts, with 0 < '{ml.key_name(LLMKV.EXPERT_GROUP_USED_COUNT)}' = "
                       f"{hp.n_group_used} < it")
    if ml.key_name(LLMKV.ROPE_SCALING_YARN_LOG_MUL) in ml.kv:
        hp.rope_yarn_log_mul /= 0.1      # llama.cpp cancels the convert script's factor
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be "
                       "> 0 for deepseek2")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_exp = hp.n_embd, hp.n_expert
    k_mla, v_mla, kv_rank = hp.n_embd_head_k_mla, hp.n_embd_head_v_mla, hp.n_lora_kv
    qk_nope = k_mla - hp.n_rot
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_head = hp.n_head(il)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        if hp.n_lora_q > 0:
            layer.attn_q_a_norm = ml.create_tensor(tn(T.ATTN_Q_A_NORM, "weight", il), (hp.n_lora_q,), dev)
            layer.wq_a = ml.create_tensor(tn(T.ATTN_Q_A, "weight", il), (n_embd, hp.n_lora_q), dev)
            layer.wq_b = ml.create_tensor(tn(T.ATTN_Q_B, "weight", il), (hp.n_lora_q, n_head * k_mla), dev)
        else:
            layer.wq = ml.create_tensor(tn(T.ATTN_Q, "weight", il), (n_embd, n_head * k_mla), dev)
        layer.attn_kv_a_norm = ml.create_tensor(tn(T.ATTN_KV_A_NORM, "weight", il), (kv_rank,), dev)
        layer.wkv_a_mqa = ml.create_tensor(tn(T.ATTN_KV_A_MQA, "weight", il), (n_embd, kv_rank + hp.n_rot), dev)
        layer.wk_b = ml.create_tensor(tn(T.ATTN_K_B, "weight", il), (qk_nope, kv_rank, n_head), dev)
        layer.wv_b = ml.create_tensor(tn(T.ATTN_V_B, "weight", il), (kv_rank, v_mla, n_head), dev)
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_head * v_mla, n_embd), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        if il < hp.n_layer_dense_lead:
            n_ff = hp.n_ff(il)
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        else:
            n_ff, n_sh = hp.n_ff_exp, hp.n_ff_exp * hp.n_expert_shared
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_exp_probs_b = ml.create_tensor(tn(T.FFN_EXP_PROBS_B, "bias", il), (n_exp,), dev,
                                                     TensorFlag.NOT_REQUIRED)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
            layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)
            layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
        model.layers.append(layer)


def kq_scale_of(hp: HParams, rope: dict) -> float:
    """llama.cpp's pre-scaled kq_scale for YaRN: mscale^2 / sqrt(head size), with the original
    attn_factor recovered from the context's adjusted one."""
    fs = rope["freq_scale"]
    attn_factor_org = rope["attn_factor"] * (1.0 + 0.1 * math.log(1.0 / fs))
    mscale = attn_factor_org * (1.0 + 0.1 * hp.rope_yarn_log_mul * math.log(1.0 / fs))
    return mscale * mscale / math.sqrt(hp.n_embd_head_k_mla)


def build_mla_qkv(g: GraphBuilder, layer: Layer, cur, inp_pos, il: int):
    """The absorbed queries [kv_rank + n_rot, n_head, T] and the latent key [kv_rank + n_rot, 1, T]."""
    hp = g.hparams
    T_, n_head, k_mla, rank, n_rot = g.n_tokens, hp.n_head(il), hp.n_embd_head_k_mla, hp.n_lora_kv, hp.n_rot
    qk_nope = k_mla - n_rot
    if layer.wq_a is not None:
        q = g.cb(ops.mul_mat(layer.wq_a, cur), "q", il)
        q = g.cb(g.build_norm(q, layer.attn_q_a_norm, None, LLMNormType.RMS, il), "q", il)
        q = g.cb(ops.mul_mat(g.need(layer.wq_b, "attn_q_b", il), q), "q", il)
    else:
        q = g.cb(ops.mul_mat(g.need(layer.wq, "attn_q", il), cur), "q", il)
    q = g.cb(ops.reshape_3d(q, k_mla, n_head, T_), "q", il)
    kv_cmpr_pe = g.cb(ops.mul_mat(g.need(layer.wkv_a_mqa, "attn_kv_a_mqa", il), cur), "kv_cmpr_pe", il)
    row = types.row_size(kv_cmpr_pe.type, rank + n_rot)
    kv_cmpr = g.cb(ops.view_2d(kv_cmpr_pe, rank, T_, row, 0), "kv_cmpr", il)
    k_pe = g.cb(ops.view_3d(kv_cmpr_pe, n_rot, 1, T_, row, row, types.row_size(kv_cmpr_pe.type, rank)), "k_pe", il)
    rope = g.rope_params(il)
    k_pe = g.cb(ops.rope_ext(k_pe, inp_pos, None, **rope), "k_pe", il)
    kv_cmpr = g.cb(g.build_norm(kv_cmpr, layer.attn_kv_a_norm, None, LLMNormType.RMS, il), "kv_cmpr", il)
    q_nope = g.cb(ops.view_3d(q, qk_nope, n_head, T_, q.nb[1], q.nb[2], 0), "q_nope", il)
    q_pe = g.cb(ops.view_3d(q, n_rot, n_head, T_, q.nb[1], q.nb[2], types.row_size(q.type, qk_nope)), "q_pe", il)
    q_pe = g.cb(ops.rope_ext(q_pe, inp_pos, None, **rope), "q_pe", il)
    q_nope = g.cb(ops.permute(q_nope, 0, 2, 1, 3), "q_nope_perm", il)
    q_abs = g.cb(ops.mul_mat(g.need(layer.wk_b, "attn_k_b", il), q_nope), "q_nope_absorbed", il)
    q_abs = g.cb(ops.permute(q_abs, 0, 2, 1, 3), "q_nope_absorbed_perm", il)
    q_cur = g.cb(ops.concat(q_abs, q_pe, 0), "Qcur", il)
    kv_cmpr = g.cb(ops.reshape_3d(kv_cmpr, rank, 1, T_), "kv_cmpr_reshape", il)
    k_cur = g.cb(ops.concat(kv_cmpr, k_pe, 0), "Kcur", il)
    g.cb(kv_cmpr, "Vcur", il)
    return q_cur, k_cur


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = kq_scale_of(hp, g.rope_params(0))
    gating = ExpertGatingFuncType(hp.expert_gating_func)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k = build_mla_qkv(g, layer, cur, inp_pos, il)
        cur = g.build_attn_mla(inp_attn, layer.wo, q, k, hp.n_lora_kv, layer.wv_b, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        if il < hp.n_layer_dense_lead:
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                                   LLMFfnGateType.PAR, il), "ffn_out", il)
        else:
            moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                      layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU,
                                      hp.expert_weights_norm, gating, il, exp_probs_b=layer.ffn_exp_probs_b,
                                      w_scale=hp.expert_weights_scale)
            shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                     LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
            cur = g.cb(ops.add(moe_out, shexp), "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
