"""Jamba: llama.cpp's src/models/jamba.cpp.

Mamba-1 blocks (mamba-base.cpp's build_mamba_layer, with Jamba's RMS norms of dt, B and C)
and attention blocks without positions in one stack; the layers without KV heads
(`attention.head_count_kv` 0 in its per-layer array) are the recurrent ones. Each layer is
followed by a gated FFN, or by a softmax mixture of experts where the layer has a router
(`ffn_gate_inp`). The context holds a hybrid memory: a KV cache for the attention layers,
per-sequence conv and SSM states for the Mamba layers."""
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
    hp.rope_type = RopeType.NONE
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    for key, value in ((LLMKV.SSM_CONV_KERNEL, hp.ssm_d_conv), (LLMKV.SSM_INNER_SIZE, hp.ssm_d_inner),
                       (LLMKV.SSM_STATE_SIZE, hp.ssm_d_state), (LLMKV.SSM_TIME_STEP_RANK, hp.ssm_dt_rank)):
        if value < 1:
            raise ml.error(f"'{ml.key_name(key)}' = {value} must be positive")
    if hp.ssm_d_inner != 2 * hp.n_embd:     # llama.cpp asserts it
        raise ml.error(f"'{ml.key_name(LLMKV.SSM_INNER_SIZE)}' = {hp.ssm_d_inner}: only an expansion factor "
                       f"of 2 (2 * n_embd = {2 * hp.n_embd}) is supported")
    hp.ssm_n_group = 0                      # Mamba-1's conv state is x alone
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]
    for il in range(hp.n_layer):
        if hp.n_ff(il) <= 0:
            raise ml.error(f"layer {il}: '{ml.key_name(LLMKV.FEED_FORWARD_LENGTH)}' = {hp.n_ff(il)} must be positive")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    d_conv, d_inner, d_state, dt_rank = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        if hp.is_recurrent(il):
            layer.ssm_in = ml.create_tensor(tn(T.SSM_IN, "weight", il), (n_embd, 2 * d_inner), dev)
            layer.ssm_conv1d = ml.create_tensor(tn(T.SSM_CONV1D, "weight", il), (d_conv, d_inner), dev)
            layer.ssm_conv1d_b = ml.create_tensor(tn(T.SSM_CONV1D, "bias", il), (d_inner,), dev)
            layer.ssm_x = ml.create_tensor(tn(T.SSM_X, "weight", il), (d_inner, dt_rank + 2 * d_state), dev)
            layer.ssm_dt_norm = ml.create_tensor(tn(T.SSM_DT_NORM, "weight", il), (dt_rank,), dev)
            layer.ssm_dt = ml.create_tensor(tn(T.SSM_DT, "weight", il), (dt_rank, d_inner), dev)
            layer.ssm_dt_b = ml.create_tensor(tn(T.SSM_DT, "bias", il), (d_inner,), dev)
            layer.ssm_b_norm = ml.create_tensor(tn(T.SSM_B_NORM, "weight", il), (d_state,), dev)
            layer.ssm_c_norm = ml.create_tensor(tn(T.SSM_C_NORM, "weight", il), (d_state,), dev)
            layer.ssm_a = ml.create_tensor(tn(T.SSM_A, None, il), (d_state, d_inner), dev)   # no "weight" suffix
            layer.ssm_d = ml.create_tensor(tn(T.SSM_D, None, il), (d_inner,), dev)
            layer.ssm_out = ml.create_tensor(tn(T.SSM_OUT, "weight", il), (d_inner, n_embd), dev)
        else:
            n_gqa = hp.n_embd_v_gqa(il)
            create_qkv(layer, ml, il, dev, n_embd, n_embd, n_gqa, n_gqa)
            layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        n_ff, n_exp = hp.n_ff(il), hp.n_expert
        layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev,
                                              TensorFlag.NOT_REQUIRED)
        if layer.ffn_gate_inp is not None:
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
        else:
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.build_inp_embd(m.tok_embd)
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = g.build_mamba_layer(inp_rs, cur, layer, il)
        else:
            q, k, v = g.build_qkv(layer, cur, il)       # no rope
            cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
        ffn_inp = ops.add(inpL, cur)
        g.cb(cur, "ffn_inp", il)        # llama.cpp gives the name to the block's output, not the sum

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        if layer.ffn_gate_inp is None:
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                                   LLMFfnGateType.PAR, il), "ffn_out", il)
        else:
            cur = g.cb(g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                       layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU,
                                       False, ExpertGatingFuncType.SOFTMAX, il,
                                       w_scale=hp.expert_weights_scale), "ffn_moe_out", il)
        inpL = g.cb(ops.add(ffn_inp, cur), "l_out", il)

    g.build_output(inpL)
