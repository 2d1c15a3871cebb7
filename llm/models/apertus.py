"""Apertus (swiss-ai Apertus-8B/70B): llama.cpp's src/models/apertus.cpp.

A LLaMA block with NEOX rope (optional rope_freqs), Q and K RMS-normed per head before rope,
and an FFN without a gate: up, then the xIELU activation with per-layer constants from the
file (xielu.*), then down."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMNormType
from llm.hparams import HParams, RopeScalingType, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.xielu_alpha_n = ml.get_key_or_arr(LLMKV.XIELU_ALPHA_N, float, hp.n_layer)
    hp.xielu_alpha_p = ml.get_key_or_arr(LLMKV.XIELU_ALPHA_P, float, hp.n_layer)
    hp.xielu_beta = ml.get_key_or_arr(LLMKV.XIELU_BETA, float, hp.n_layer)
    hp.xielu_eps = ml.get_key_or_arr(LLMKV.XIELU_EPS, float, hp.n_layer)
    if hp.rope_scaling_type_train == RopeScalingType.LONGROPE:
        raise ml.error("Apertus with LongRoPE factors (rope_factors_long/short) is not supported")
    if not hp.n_embd_head_k == hp.n_embd_head_v == hp.n_rot:
        raise ml.error(f"Apertus rotates whole heads: '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot}, "
                       f"head sizes {hp.n_embd_head_k} / {hp.n_embd_head_v}")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, d = hp.n_embd, hp.n_embd_head_k
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_head(il) * d
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        flags = TensorFlag.NOT_REQUIRED | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, TensorFlag.NOT_REQUIRED)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (hp.n_ff(il), n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, hp.n_ff(il)), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (d,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (d,), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_k)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        q = g.cb(ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Qcur_pos", il)
        k = g.cb(ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Kcur_pos", il)
        v = g.cb(v, "Vcur_pos", il)
        cur = g.cb(g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il), "attn_out", il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        up = g.cb(g.build_lora_mm(g.need(layer.ffn_up, "ffn_up", il), cur), "ffn_up", il)
        act = g.cb(ops.xielu(up, hp.xielu_alpha_n[il], hp.xielu_alpha_p[il], hp.xielu_beta[il], hp.xielu_eps[il]),
                   "ffn_xielu", il)
        cur = g.cb(g.build_lora_mm(g.need(layer.ffn_down, "ffn_down", il), act), "ffn_down", il)
        cur = g.cb(ops.add(cur, ffn_inp), "ffn_out", il)
        inpL = g.cb(cur, "l_out", il)

    g.build_output(inpL)
