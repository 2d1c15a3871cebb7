"""Granite 3 (dense): llama.cpp's src/models/granite.cpp.

The llama block with IBM's multipliers: input embeddings times `embedding_scale`, attention
logits scaled by `attention.scale`, each block's attention and FFN outputs times
`residual_scale` before they join the residual, and logits divided by `logit_scale`.
`rope.scaling.finetuned` = false turns rope off (llama.cpp's rope switch for Granite).
Granite MoE (llm/models/granitemoe.py) shares this graph: softmax-routed experts (weights
renormalized) and an optional shared expert instead of the dense FFN."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_attn, create_embd_output, create_ffn
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.f_logit_scale = ml.get_key(LLMKV.LOGIT_SCALE, float)
    if hp.f_logit_scale == 0.0:
        raise ml.error(f"'{ml.key_name(LLMKV.LOGIT_SCALE)}' must not be 0 (logits are divided by it)")
    hp.f_residual_scale = ml.get_key(LLMKV.RESIDUAL_SCALE, float, 0.0)
    hp.f_embedding_scale = ml.get_key(LLMKV.EMBEDDING_SCALE, float, 0.0)
    hp.f_attention_scale = ml.get_key(LLMKV.ATTENTION_SCALE, float, 0.0)
    hp.rope_finetuned = ml.get_key(LLMKV.ROPE_SCALING_FINETUNED, bool, True)
    hp.rope_layers = [hp.rope_finetuned] * hp.n_layer


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    opt = TensorFlag.NOT_REQUIRED
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (hp.n_embd,), dev, opt)
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
        if hp.n_expert == 0:
            create_ffn(layer, ml, hp, il, dev)
            layer.ffn_gate_b = ml.create_tensor(tn(T.FFN_GATE, "bias", il), (n_ff,), dev, opt)
            layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, opt)
            layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, opt)
        else:       # granitemoe: experts of width n_ff, optionally a shared expert
            n_exp = hp.n_expert
            layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            if hp.n_ff_shexp > 0:
                n_sh = hp.n_ff_shexp
                layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)
        flags = opt | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_k)
    res_scale = hp.f_residual_scale

    inpL = g.build_inp_embd(m.tok_embd)
    if hp.f_embedding_scale:
        inpL = g.cb(ops.scale(inpL, hp.f_embedding_scale), "inp_scaled")
    inp_pos = g.build_inp_pos() if hp.has_rope(0) else None
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        if inp_pos is not None:
            q = g.cb(ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Qcur", il)
            k = g.cb(ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Kcur", il)
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        if res_scale:
            cur = ops.scale(cur, res_scale)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        if layer.ffn_gate_inp is None:
            cur = g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                              LLMFfnOpType.SILU, LLMFfnGateType.PAR, il,
                              up_b=layer.ffn_up_b, gate_b=layer.ffn_gate_b, down_b=layer.ffn_down_b)
        else:
            moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                      layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True,
                                      ExpertGatingFuncType.SOFTMAX, il)
            if layer.ffn_up_shexp is not None:
                shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                         LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
                moe_out = ops.add(moe_out, shexp)
            cur = moe_out
        g.cb(cur, "ffn_out", il)        # as llama.cpp: before the residual scale
        if res_scale:
            cur = ops.scale(cur, res_scale)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL, logit_scale=1.0 / hp.f_logit_scale)
