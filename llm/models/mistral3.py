"""Mistral 3 (the text model of Mistral Small 3.x / Devstral / Magistral GGUFs): llama.cpp's
src/models/mistral3.cpp.

The llama block (RMS pre-norms, NORM rope, GQA, SiLU-gated FFN with optional biases, optional
output bias) plus llama4-style attention temperature tuning: when
`attention.temperature_scale` is set, queries are multiplied per token by
log(floor(pos / n_ctx_orig) + 1) * temperature_scale + 1."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_attn, create_embd_output, create_ffn
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.f_attn_temp_scale = ml.get_key(LLMKV.ATTENTION_TEMPERATURE_SCALE, float, 0.0)
    hp.f_attn_temp_offset = 0.0
    if hp.f_attn_temp_scale != 0.0:
        hp.n_attn_temp_floor_scale = hp.n_ctx_orig_yarn
        if hp.n_attn_temp_floor_scale == 0:
            raise ml.error(f"'{ml.key_name(LLMKV.ROPE_SCALING_ORIG_CTX_LEN)}' must be positive for "
                           f"attention temperature scaling")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    opt = TensorFlag.NOT_REQUIRED
    if hp.n_expert:
        raise ml.error("mistral3 with experts is not supported yet (only the dense model)")
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (hp.n_embd,), dev, opt)
        create_ffn(layer, ml, hp, il, dev)
        n_ff = hp.n_ff(il)
        layer.ffn_gate_b = ml.create_tensor(tn(T.FFN_GATE, "bias", il), (n_ff,), dev, opt)
        layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (hp.n_embd,), dev, opt)
        layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, opt)
        flags = opt | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_v)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn_scale = g.build_inp_attn_scale() if hp.f_attn_temp_scale else None
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Kcur", il)
        if inp_attn_scale is not None:
            q = g.cb(ops.mul(q, inp_attn_scale), "Qcur_attn_temp_scaled", il)
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU, LLMFfnGateType.PAR, il,
                          up_b=layer.ffn_up_b, gate_b=layer.ffn_gate_b, down_b=layer.ffn_down_b)
        g.cb(cur, "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
