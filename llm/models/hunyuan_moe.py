"""Hunyuan-MoE (Hunyuan-A13B): llama.cpp's src/models/hunyuan-moe.cpp.

A LLaMA-style attention whose queries and keys are RMS-normed per head after rope, and an
FFN of a shared SiLU expert beside softmax-routed SiLU experts (top-k weights
renormalized), both reading the same normed input. The experts are feed_forward_length
wide; the shared one expert_shared_feed_forward_length when given."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' "
                       f"must be > 0 for hunyuan-moe")
    if not (hp.n_embd_head_k == hp.n_embd_head_v == hp.n_rot):
        raise ml.error(f"hunyuan-moe rotates whole heads: '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot} "
                       f"must equal the key and value head sizes {hp.n_embd_head_k} / {hp.n_embd_head_v}")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_expert, d_k = hp.n_embd, hp.n_expert, hp.n_embd_head_k
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_ff = hp.n_ff(il)
        n_ff_shexp = hp.n_ff_shexp if hp.n_ff_shexp > 0 else n_ff
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, d_k * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (d_k * hp.n_head(il), n_embd), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (d_k,), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (d_k,), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_expert), dev)
        layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_expert), dev)
        layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_expert), dev)
        layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_expert), dev)
        layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_ff_shexp), dev)
        layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_ff_shexp), dev)
        layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_ff_shexp, n_embd), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_v)

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
        k = ops.rope_ext(k, inp_pos, None, **g.rope_params(il))
        # normed after rope, unlike qwen3's
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_norm", il)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_norm", il)
        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur_mlp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                   LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_mlp", il)
        cur_moe = g.cb(g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                       layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU,
                                       True, ExpertGatingFuncType.SOFTMAX, il, w_scale=hp.expert_weights_scale),
                       "ffn_moe_out", il)
        ffn_out = g.cb(ops.add(cur_moe, cur_mlp), "ffn_out", il)
        inpL = g.cb(ops.add(ffn_out, ffn_inp), "l_out", il)

    g.build_output(inpL)
