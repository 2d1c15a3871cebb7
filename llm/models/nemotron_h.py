"""Nemotron-H: llama.cpp's src/models/nemotron-h.cpp (the dense models; the MoE variant
nemotron_h_moe is not built here).

Three kinds of layer, each an RMS norm and a residual: Mamba-2 blocks (no KV heads and no
FFN), attention without positions (no rope; FFN width 0) and squared-ReLU FFNs without a
gate (no KV heads, an FFN). The context holds a hybrid memory: a KV cache for the attention
layers, per-sequence states for the Mamba-2 layers."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_mamba2, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag
from llm.models.mamba2 import check_mamba2

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NONE
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_n_group = ml.get_key(LLMKV.SSM_GROUP_COUNT, int)
    check_mamba2(hp, ml)
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 and hp.n_ff(il) == 0 for il in range(hp.n_layer)]
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float, 0.0)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float, hp.f_norm_eps)
    if hp.n_expert:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' = {hp.n_expert}: Nemotron-H's mixture-of-experts "
                       f"layers (nemotron_h_moe) are not supported")
    for il in range(hp.n_layer):
        if hp.n_head_kv(il) and hp.n_ff(il):
            raise ml.error(f"layer {il} has both KV heads ('{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT_KV)}') and "
                           f"an FFN ('{ml.key_name(LLMKV.FEED_FORWARD_LENGTH)}'): a Nemotron-H layer is one of them")


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
        elif hp.n_ff(il) == 0:
            n_q = hp.n_embd_head_k * hp.n_head(il)
            create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
            layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
            layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, opt)
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, opt)
            layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, opt)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_out_ids = g.build_inp_out_ids()
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_k)

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = g.build_mamba2_layer(inp_rs, cur, layer, il)
        elif hp.n_ff(il) == 0:
            q, k, v = g.build_qkv(layer, cur, il)
            cur = g.cb(g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il), "attn_out", il)
        else:
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, None, layer.ffn_down, LLMFfnOpType.RELU_SQR,
                                   LLMFfnGateType.SEQ, il, up_b=layer.ffn_up_b, down_b=layer.ffn_down_b),
                       "ffn_out", il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        inpL = g.cb(ops.add(cur, inpSA), "nemotron_h_block_out", il)

    g.build_output(inpL)
