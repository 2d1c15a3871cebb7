"""Qwen3-MoE: llama.cpp's src/models/qwen3moe.cpp.

Qwen3's attention (RMS-normed Q and K per head, NEOX rope, no biases) with a softmax-gated
mixture of SiLU experts in every layer, top-k weights renormalized to sum to 1."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_attn, create_embd_output
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_moe_hparams(hp: HParams, ml: GGUFMeta) -> None:
    """The expert keys every MoE architecture here reads, with llama.cpp's load-time checks."""
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer, [0] * hp.n_layer)[0]
    if hp.n_expert == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' must be > 0 for {ml.arch_name}")
    if hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be > 0 for {ml.arch_name}")


def n_ff_exp(hp: HParams, il: int) -> int:
    return hp.n_ff_exp if hp.n_ff_exp else hp.n_ff(il) // hp.n_expert_used


def create_experts(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev) -> None:
    """ffn_norm, the router and the stacked expert matrices [n_embd, n_ff_exp, n_expert]."""
    n_embd, n_exp, n_ff = hp.n_embd, hp.n_expert, n_ff_exp(hp, il)
    layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
    layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
    layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
    layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
    layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    load_moe_hparams(hp, ml)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
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
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, "rms", il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, "rms", il), "Qcur_normed", il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, "rms", il), "Kcur_normed", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, "rms", il), "ffn_norm", il)
        cur = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                              layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, True, il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
