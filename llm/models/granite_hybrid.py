"""Granite 4 (hybrid): llama.cpp's src/models/granite-hybrid.cpp.

Mamba-2 blocks (mamba-base.cpp's build_mamba2_layer) and attention blocks in one stack; the
layers without KV heads (`attention.head_count_kv` 0 in its per-layer array) are the
recurrent ones. Every layer is followed by a gated FFN or a softmax-routed MoE with an
optional shared expert, with Granite's embedding, residual, attention and logit scales (the
embedding scale on the token embeddings, as llama.cpp's build_inp_embd applies it). The
context holds a hybrid memory: a KV cache for the attention layers, per-sequence states for
the Mamba layers."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, InpAttnKV, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_embd_output, create_mamba2, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag
from llm.models.mamba2 import check_mamba2

if TYPE_CHECKING:
    from ggmlx.tensor import Tensor
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.f_logit_scale = ml.get_key(LLMKV.LOGIT_SCALE, float, 0.0)
    hp.f_residual_scale = ml.get_key(LLMKV.RESIDUAL_SCALE, float, 0.0)
    hp.f_embedding_scale = ml.get_key(LLMKV.EMBEDDING_SCALE, float, 0.0)
    hp.f_attention_scale = ml.get_key(LLMKV.ATTENTION_SCALE, float, 0.0)
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_n_group = ml.get_key(LLMKV.SSM_GROUP_COUNT, int)
    check_mamba2(hp, ml)
    if hp.ssm_d_inner != 2 * hp.n_embd:     # llama.cpp asserts it
        raise ml.error(f"'{ml.key_name(LLMKV.SSM_INNER_SIZE)}' = {hp.ssm_d_inner} must be 2 * n_embd = {2 * hp.n_embd}")
    hp.rope_finetuned = ml.get_key(LLMKV.ROPE_SCALING_FINETUNED, bool, True)
    hp.rope_layers = [hp.rope_finetuned] * hp.n_layer
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    hp.expert_weights_scale = ml.get_key(LLMKV.EXPERT_WEIGHTS_SCALE, float, 0.0)
    for il in range(hp.n_layer):
        if hp.n_ff(il) <= 0:
            raise ml.error(f"layer {il}: '{ml.key_name(LLMKV.FEED_FORWARD_LENGTH)}' = {hp.n_ff(il)} must be positive")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    opt = TensorFlag.NOT_REQUIRED
    create_embd_output(model, ml)
    n_embd = hp.n_embd
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        if hp.is_recurrent(il):
            create_mamba2(layer, ml, hp, il, dev, conv_bias=opt)
        else:
            n_q = hp.n_embd_head_k * hp.n_head(il)
            create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
            layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
            layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, opt)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        flags = opt | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        n_ff = hp.n_ff(il)
        if hp.n_expert > 0:
            n_exp = hp.n_expert
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev, opt)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            if hp.n_ff_shexp > 0:
                n_sh = hp.n_ff_shexp
                layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)
        else:
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_gate_b = ml.create_tensor(tn(T.FFN_GATE, "bias", il), (n_ff,), dev, opt)
            layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, opt)
            layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, opt)
        model.layers.append(layer)


def build_attention_layer(g: GraphBuilder, cur: Tensor, inp_pos: Tensor | None, inp_attn: InpAttnKV,
                          layer: Layer, il: int) -> Tensor:
    hp = g.hparams
    q, k, v = g.build_qkv(layer, cur, il)
    if inp_pos is not None and hp.has_rope(il):
        q = ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il))
        k = ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il))
    g.cb(q, "Qcur", il)
    g.cb(k, "Kcur", il)
    g.cb(v, "Vcur", il)
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_k)
    return g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)


def build_layer_ffn(g: GraphBuilder, cur: Tensor, inpSA: Tensor, layer: Layer, il: int) -> Tensor:
    hp = g.hparams
    if hp.f_residual_scale:
        cur = ops.scale(cur, hp.f_residual_scale)
    ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
    cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
    if layer.ffn_gate_inp is None:
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                               LLMFfnGateType.PAR, il, up_b=layer.ffn_up_b, gate_b=layer.ffn_gate_b,
                               down_b=layer.ffn_down_b), "ffn_out", il)
    else:
        moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                  layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True,
                                  ExpertGatingFuncType.SOFTMAX, il, w_scale=hp.expert_weights_scale)
        if hp.n_ff_shexp > 0:
            shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                     LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
            cur = g.cb(ops.add(moe_out, shexp), "ffn_out", il)
        else:
            cur = moe_out
    if hp.f_residual_scale:
        cur = ops.scale(cur, hp.f_residual_scale)
    cur = g.cb(ops.add(cur, ffn_inp), "ffn_out", il)
    return g.cb(cur, "l_out", il)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    if hp.f_embedding_scale:
        inpL = g.cb(ops.scale(inpL, hp.f_embedding_scale), "inp_scaled")
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_out_ids = g.build_inp_out_ids()
    inp_pos = g.build_inp_pos() if hp.has_rope(0) else None

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = g.build_mamba2_layer(inp_rs, cur, layer, il)
        else:
            cur = build_attention_layer(g, cur, inp_pos, inp_attn, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        inpL = build_layer_ffn(g, cur, inpSA, layer, il)

    g.build_output(inpL, logit_scale=1.0 / hp.f_logit_scale if hp.f_logit_scale else 1.0)
