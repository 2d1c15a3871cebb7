"""Falcon-H1: llama.cpp's src/models/falcon-h1.cpp.

Every layer runs attention (NEOX rope) and a Mamba-2 block (mamba-base.cpp's
build_mamba2_layer, its inner width free of n_embd, its grouped norm optional) side by side
on the same RMS norm and adds both to the residual, then a gated FFN. Falcon-H1's muP
multipliers are folded into the weights by the GGUF conversion, so the graph has none, as in
llama.cpp. The context holds a hybrid memory in which every layer has a KV cache and
recurrent states."""
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
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_n_group = ml.get_key(LLMKV.SSM_GROUP_COUNT, int)
    check_mamba2(hp, ml)
    hp.recurrent_layers = [True] * hp.n_layer       # and every layer attends too
    for il in range(hp.n_layer):
        if hp.n_head_kv(il) == 0:
            raise ml.error(f"layer {il}: '{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT_KV)}' = 0: every Falcon-H1 "
                           f"layer has attention")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    opt = TensorFlag.NOT_REQUIRED
    create_embd_output(model, ml)
    n_embd = hp.n_embd
    n_q = hp.n_embd_head_k * hp.n_head(0)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_mamba2(layer, ml, hp, il, dev, conv_bias=opt, norm=opt)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(0), hp.n_embd_v_gqa(0))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        # loaded but not used by llama.cpp's graph (its build_attn gets no output bias, its rope no freqs)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, opt)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, None, il), (n_embd,), dev)     # no "weight" suffix
        flags = opt | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        n_ff = hp.n_ff(0)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_gate_b = ml.create_tensor(tn(T.FFN_GATE, "bias", il), (n_ff,), dev, opt)
        layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, opt)
        layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, opt)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_v)
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)

        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur-post-rope", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur-post-rope", il)
        g.cb(v, "Vcur-post-rope", il)
        attn_out = g.cb(g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il), "attn_out", il)

        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "ssm_in", il)
        ssm_out = g.cb(g.build_mamba2_layer(inp_rs, cur, layer, il), "ssm_out", il)

        cur = ops.add(attn_out, ssm_out)
        inpSA = ops.add(cur, inpSA)
        g.cb(cur, "layer_out", il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(inpSA, "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                               LLMFfnGateType.PAR, il, up_b=layer.ffn_up_b, gate_b=layer.ffn_gate_b,
                               down_b=layer.ffn_down_b), "ffn_out", il)
        inpL = g.cb(ops.add(cur, inpSA), "l_out", il)

    g.build_output(inpL)
