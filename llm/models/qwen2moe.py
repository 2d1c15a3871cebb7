"""Qwen2-MoE (Qwen1.5-MoE): llama.cpp's src/models/qwen2moe.cpp.

Qwen2's attention (Q/K/V biases, NEOX rope) with a softmax-gated mixture of SiLU experts
(top-k weights not renormalized) plus a shared SiLU expert whose output is scaled by a
sigmoid gate, sigmoid(g) computed as silu(g) / g as llama.cpp does."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_embd_output, create_experts, create_qkv, load_moe_hparams
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    load_moe_hparams(hp, ml)
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, n_embd, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
        create_experts(layer, ml, hp, il, dev)
        n_ff_sh = hp.n_ff_shexp if hp.n_ff_shexp else hp.n_ff(il)
        layer.ffn_gate_inp_shexp = ml.create_tensor(tn(T.FFN_GATE_INP_SHEXP, "weight", il), (n_embd,), dev)
        layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_ff_sh), dev)
        layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_ff_sh, n_embd), dev)
        layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_ff_sh), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                  layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, False,
                                  ExpertGatingFuncType.SOFTMAX, il)
        shexp_gate_inp = g.need(layer.ffn_gate_inp_shexp, "ffn_gate_inp_shexp", il)
        gate_inp = g.cb(g.build_lora_mm(shexp_gate_inp, cur), "ffn_shexp_gate_inp", il)
        gate = g.cb(ops.div(ops.silu(gate_inp), gate_inp), "ffn_shexp_gate", il)
        shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                 LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
        shexp = g.cb(ops.mul(shexp, gate), "ffn_shexp_out", il)
        cur = g.cb(ops.add(moe_out, shexp), "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
