"""GLM-4.5 / 4.6 (glm4moe): llama.cpp's src/models/glm4-moe.cpp.

RMS pre-norm attention (Q/K/V with biases, optional per-head Q/K norms, NEOX rope over part of
each head), then post_attention_norm before the FFN: `leading_dense_block_count` dense layers,
then sigmoid-gated experts chosen with a selection bias (exp_probs_b), their weights
renormalized and scaled, plus shared experts. The file's last `nextn_predict_layers` blocks are
the MTP head, claimed but not loaded or run (as llama.cpp without MTP). M-RoPE (GLM-4.5V) is
refused until the multimodal issue."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.drop_nextn_layers(ml.get_key(LLMKV.NEXTN_PREDICT_LAYERS, int, 0))
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer + hp.n_layer_nextn)[0]
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    sections = ml.get_key_or_arr(LLMKV.ROPE_DIMENSION_SECTIONS, int, 4, [0, 0, 0, 0])
    if any(sections):
        raise ml.error(f"'{ml.key_name(LLMKV.ROPE_DIMENSION_SECTIONS)}' = {list(sections)}: GLM-4.5V's M-RoPE "
                       "is not supported yet")
    hp.n_expert_shared = ml.get_key(LLMKV.EXPERT_SHARED_COUNT, int)
    hp.n_layer_dense_lead = ml.get_key(LLMKV.LEADING_DENSE_BLOCK_COUNT, int, 0)
    hp.expert_weights_scale = ml.get_key(LLMKV.EXPERT_WEIGHTS_SCALE, float, 0.0)
    hp.expert_weights_norm = ml.get_key(LLMKV.EXPERT_WEIGHTS_NORM, bool, False)
    gating = ml.get_key(LLMKV.EXPERT_GATING_FUNC, int, int(ExpertGatingFuncType.NONE))
    hp.expert_gating_func = int(ExpertGatingFuncType.SIGMOID) if gating == ExpertGatingFuncType.NONE else gating
    if hp.expert_gating_func not in (ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SIGMOID):
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_GATING_FUNC)}' = {gating}: glm4moe gates by softmax (1) or "
                       "sigmoid (2)")
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be "
                       "> 0 for glm4moe")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_exp = hp.n_embd, hp.n_expert
    create_embd_output(model, ml)
    opt = TensorFlag.NOT_REQUIRED
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_embd_head_k * hp.n_head(il)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev, opt)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev, opt)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        if il >= hp.n_layer_dense_lead:
            n_ff = hp.n_ff_exp if hp.n_ff_exp else hp.n_ff(il) // hp.n_expert_used
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_exp_probs_b = ml.create_tensor(tn(T.FFN_EXP_PROBS_B, "bias", il), (n_exp,), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            if hp.n_expert_shared > 0:
                n_sh = n_ff * hp.n_expert_shared
                layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)
                layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
        else:
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, hp.n_ff(il)), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (hp.n_ff(il), n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, hp.n_ff(il)), dev)
        model.layers.append(layer)
    for il in range(hp.n_layer, hp.n_layer + hp.n_layer_nextn):
        ml.skip_tensors(f"blk.{il}.")


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
    gating = ExpertGatingFuncType(hp.expert_gating_func)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        if layer.attn_q_norm is not None:
            q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        if layer.attn_k_norm is not None:
            k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.attn_post_norm, None, LLMNormType.RMS, il), "post_attn_norm", il)
        if il < hp.n_layer_dense_lead:
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                                   LLMFfnGateType.PAR, il), "ffn_out", il)
        else:
            routed = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                     layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU,
                                     hp.expert_weights_norm, gating, il, exp_probs_b=layer.ffn_exp_probs_b,
                                     w_scale=hp.expert_weights_scale)
            shared = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                      LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp_out", il)
            cur = g.cb(ops.add(routed, shared), "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
