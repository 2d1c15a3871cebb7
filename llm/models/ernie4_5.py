"""ERNIE 4.5 (0.3B dense): llama.cpp's src/models/ernie4-5.cpp, which also declares the tensors
of its MoE variant (llm/models/ernie4_5_moe.py).

A LLaMA block (RMS norms, NORM rope over whole heads, SiLU-gated FFN); Q/K/V fused or separate
with optional biases; an attention output bias may be in the file, which llama.cpp loads and
the graph does not use."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, LLMArch, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    sections = ml.get_key_or_arr(LLMKV.ROPE_DIMENSION_SECTIONS, int, 4, [0, 0, 0, 0])
    if any(sections):
        raise ml.error(f"'{ml.key_name(LLMKV.ROPE_DIMENSION_SECTIONS)}' = {list(sections)}: PaddleOCR's M-RoPE "
                       "(ggml_rope_multi) is not supported yet")
    if hp.n_rot != hp.n_embd_head_k:
        raise ml.error(f"invalid '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot}: "
                       f"ERNIE 4.5 rotates whole heads, expected {hp.n_embd_head_k}")


def is_moe_tensors(hp: HParams, il: int) -> bool:
    """llama.cpp declares experts for every layer from n_layer_dense_lead on."""
    return hp.arch == LLMArch.ERNIE4_5_MOE and il >= hp.n_layer_dense_lead


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        n_q = hp.n_embd_head_k * hp.n_head(il)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, TensorFlag.NOT_REQUIRED)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        if is_moe_tensors(hp, il):
            n_ff, n_exp, opt = hp.n_ff_exp, hp.n_expert, TensorFlag.NOT_REQUIRED
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_exp_probs_b = ml.create_tensor(tn(T.FFN_EXP_PROBS_B, "bias", il), (n_exp,), dev, opt)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev, opt)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            if hp.n_ff_shexp > 0:
                n_sh = hp.n_ff_shexp
                layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
                layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)
                layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        model.layers.append(layer)


def build_attn_block(g: GraphBuilder, layer: Layer, inpL, inp_pos, inp_attn, inp_out_ids, il: int):
    """attn_norm -> rope'd attention (no output bias in the graph) -> ffn_inp."""
    hp = g.hparams
    inpSA = inpL
    cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
    q, k, v = g.build_qkv(layer, cur, il)
    q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
    k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
    cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_k), il)
    if il == hp.n_layer - 1 and inp_out_ids is not None:
        cur = ops.get_rows(cur, inp_out_ids)
        inpSA = ops.get_rows(inpSA, inp_out_ids)
    return g.cb(ops.add(cur, inpSA), "ffn_inp", il)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    for il in range(hp.n_layer):
        layer = m.layers[il]
        ffn_inp = build_attn_block(g, layer, inpL, inp_pos, inp_attn, inp_out_ids, il)
        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                               LLMFfnGateType.PAR, il), "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    g.build_output(inpL)
