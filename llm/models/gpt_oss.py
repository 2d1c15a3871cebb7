"""gpt-oss: llama.cpp's src/models/openai-moe.cpp.

RMS pre-norms; sliding-window and global attention layers alternating (even layers SWA),
each with per-head attention sinks and Q/K/V/output biases, NEOX rope; a mixture of experts
in every layer with a biased router whose chosen logits are softmaxed ("softmax_weight"),
biased experts (usually MXFP4) and gpt-oss's clamped SwiGLU."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType, SWAType, load_swa_pattern
from llm.layer import Layer, create_qkv, load_moe_hparams
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    load_moe_hparams(hp, ml)
    if hp.n_ff_exp == 0:
        raise ml.error(f"missing required key '{ml.key_name(LLMKV.EXPERT_FEED_FORWARD_LENGTH)}'")
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int)
    hp.swa_type = SWAType.STANDARD
    load_swa_pattern(hp, ml, 2)
    hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
    hp.rope_freq_scale_train_swa = hp.rope_freq_scale_train


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_exp, n_ff = hp.n_embd, hp.n_expert, hp.n_ff_exp
    dev_out = model.place.dev_output
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (n_embd, hp.n_vocab), model.place.dev_input)
    model.output_norm = ml.create_tensor(tn(T.OUTPUT_NORM, "weight"), (n_embd,), dev_out)
    model.output = ml.create_tensor(tn(T.OUTPUT, "weight"), (n_embd, hp.n_vocab), dev_out)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q, n_kv = hp.n_head(il) * hp.n_rot, hp.n_head_kv(il) * hp.n_rot
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, n_q, n_kv, n_kv)
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.attn_sinks = ml.create_tensor(tn(T.ATTN_SINKS, "weight", il), (hp.n_head(il),), dev)
        layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
        layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
        layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
        layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
        layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev)
        layer.ffn_gate_inp_b = ml.create_tensor(tn(T.FFN_GATE_INP, "bias", il), (n_exp,), dev)
        layer.ffn_gate_exps_b = ml.create_tensor(tn(T.FFN_GATE_EXPS, "bias", il), (n_ff, n_exp), dev)
        layer.ffn_down_exps_b = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "bias", il), (n_embd, n_exp), dev)
        layer.ffn_up_exps_b = ml.create_tensor(tn(T.FFN_UP_EXPS, "bias", il), (n_ff, n_exp), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_rot)

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
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il, sinks=layer.attn_sinks)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        cur = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                              hp.n_expert, hp.n_expert_used, LLMFfnOpType.SWIGLU_OAI_MOE, False,
                              ExpertGatingFuncType.SOFTMAX_WEIGHT, il, gate_inp_b=layer.ffn_gate_inp_b,
                              up_exps_b=layer.ffn_up_exps_b, gate_exps_b=layer.ffn_gate_exps_b,
                              down_exps_b=layer.ffn_down_exps_b)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
