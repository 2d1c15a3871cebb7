"""Phi-3: llama.cpp's src/models/phi3.cpp.

Fused QKV projection (Q, K and V are views of its rows), NEOX rope, queries scaled before
attention, and a fused [gate; up] FFN projection with SwiGLU."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType, SWAType
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    # llama.cpp disables Phi-3's sliding window (its converters do not describe the pattern)
    hp.swa_type = SWAType.NONE
    hp.n_swa = 0
    hp.set_swa_pattern(1)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        n_ff, n_head = hp.n_ff(il), hp.n_head(il)
        n_qkv = hp.n_embd_head_k * n_head + hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        layer.wqkv = ml.create_tensor(tn(T.ATTN_QKV, "weight", il), (n_embd, n_qkv), dev)
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (hp.n_embd_head_v * n_head, n_embd), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, 2 * n_ff), dev)
        # LongRoPE factors (Phi-3 128k); absent from the short-context models
        flags = TensorFlag.NOT_REQUIRED | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FACTORS_SHORT, "weight"), (hp.n_rot // 2,), dev, flags)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        residual = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Qcur", il)
        q = g.cb(ops.scale(q, 1.0 / math.sqrt(hp.n_embd_head_k)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, 1.0, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            residual = ops.get_rows(residual, inp_out_ids)
        cur = g.cb(ops.add(cur, residual), "ffn_inp", il)
        residual = cur

        cur = g.cb(g.build_norm(cur, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, None, layer.ffn_down,
                               LLMFfnOpType.SWIGLU, LLMFfnGateType.SEQ, il), "ffn_out", il)
        inpL = g.cb(ops.add(residual, cur), "l_out", il)

    g.build_output(inpL)
