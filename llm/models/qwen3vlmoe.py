"""Qwen3-VL-MoE's text tower: llama.cpp's src/models/qwen3vlmoe.cpp.

Qwen3-VL's attention (RMS-normed query and key heads, interleaved M-RoPE) with Qwen3-MoE's
softmax-gated SiLU experts, top-k weights renormalized, in every layer. DeepStack is as in
qwen3vl: the slices an image embedding adds to the first layers (zero for text)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMTensor as T
from llm.arch import tn
from llm.graph import GraphBuilder, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams
from llm.layer import Layer, create_embd_output, create_experts, create_qkv, load_moe_hparams
from llm.loader import GGUFMeta, ModelLoader
from llm.models import qwen3vl

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    qwen3vl.load_hparams(hp, ml)
    load_moe_hparams(hp, ml)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_embd_head_k * hp.n_head(il)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        create_qkv(layer, ml, il, dev, hp.n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, hp.n_embd), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        create_experts(layer, ml, hp, il, dev)
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
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        q = g.cb(ops.rope_multi(q, inp_pos, None, **g.rope_multi_params(il)), "Qcur", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        k = g.cb(ops.rope_multi(k, inp_pos, None, **g.rope_multi_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                              layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True,
                              ExpertGatingFuncType.SOFTMAX, il)
        inpL = qwen3vl.add_deepstack(g, g.cb(ops.add(cur, ffn_inp), "l_out", il), il)

    g.build_output(inpL)
