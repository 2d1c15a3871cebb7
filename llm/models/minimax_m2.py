"""MiniMax-M2: llama.cpp's src/models/minimax-m2.cpp.

A pre-norm block whose Q and K are RMS-normed over all heads at once (before the heads split),
NEOX rope over part of each head (n_rot below the head size), and in every layer a mixture of
experts gated by `expert_gating_func` (sigmoid in the released models) with a selection bias,
renormalized weights."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.expert_gating_func = ml.get_key(LLMKV.EXPERT_GATING_FUNC, int, int(ExpertGatingFuncType.NONE))
    if hp.expert_gating_func not in (ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SIGMOID):
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_GATING_FUNC)}' = {hp.expert_gating_func}: minimax-m2 needs "
                       "softmax (1) or sigmoid (2) gating")
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be "
                       "> 0 for minimax-m2")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    """output.weight is required (not tied); the experts are n_ff wide, as llama.cpp declares them."""
    hp = model.hparams
    n_embd = hp.n_embd
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (n_embd, hp.n_vocab), model.place.dev_input)
    model.output_norm = ml.create_tensor(tn(T.OUTPUT_NORM, "weight"), (n_embd,), model.place.dev_output)
    model.output = ml.create_tensor(tn(T.OUTPUT, "weight"), (n_embd, hp.n_vocab), model.place.dev_output)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_embd_head_k * hp.n_head(il)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (n_q,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_k_gqa(il),), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        n_ff, n_exp = hp.n_ff(il), hp.n_expert
        layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
        layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
        layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
        layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
        layer.ffn_exp_probs_b = ml.create_tensor(tn(T.FFN_EXP_PROBS_B, "bias", il), (n_exp,), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    d = hp.n_embd_head_k
    gating = ExpertGatingFuncType(hp.expert_gating_func)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q, k = g.build_qk_norm_all_heads(layer, q, k, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, 1.0 / math.sqrt(d), il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                              hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True, gating, il,
                              exp_probs_b=layer.ffn_exp_probs_b, w_scale=hp.expert_weights_scale)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
