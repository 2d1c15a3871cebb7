"""Phi-2: llama.cpp's src/models/phi2.cpp.

One LayerNorm per block feeds attention and FFN in parallel; their outputs and the block
input are summed. Partial NEOX rope (rope.dimension_count < head size), Q pre-scaled by
1/sqrt(head size), Q/K/V (or fused QKV) with biases, a sequential GELU FFN with biases, and
an output projection with a bias."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_ln_block
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    dev_out = model.place.dev_output
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (hp.n_embd, hp.n_vocab), model.place.dev_input)
    model.output_norm = ml.create_tensor(tn(T.OUTPUT_NORM, "weight"), (hp.n_embd,), dev_out)
    model.output_norm_b = ml.create_tensor(tn(T.OUTPUT_NORM, "bias"), (hp.n_embd,), dev_out)
    model.output = ml.create_tensor(tn(T.OUTPUT, "weight"), (hp.n_embd, hp.n_vocab), dev_out)
    model.output_b = ml.create_tensor(tn(T.OUTPUT, "bias"), (hp.n_vocab,), dev_out)
    for il in range(hp.n_layer):
        layer = Layer()
        create_ln_block(layer, ml, hp, il, model.place.dev_layer[il], ffn_norm=False)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    d = hp.n_embd_head_v

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        attn_norm_out = g.build_norm(inpL, layer.attn_norm, layer.attn_norm_b, LLMNormType.NORM, il)
        attn_norm_out = g.cb(attn_norm_out, "attn_norm", il)
        q, k, v = g.build_qkv(layer, attn_norm_out, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        # Q scaled ahead of attention (llama.cpp does so to avoid fp16 overflow)
        q = g.cb(ops.scale(q, 1.0 / math.sqrt(d)), "Qcur_scaled", il)
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, 1.0, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
            attn_norm_out = ops.get_rows(attn_norm_out, inp_out_ids)
        ffn_out = g.build_ffn(attn_norm_out, layer.ffn_up, None, layer.ffn_down,
                              LLMFfnOpType.GELU, LLMFfnGateType.SEQ, il,
                              up_b=layer.ffn_up_b, down_b=layer.ffn_down_b)
        g.cb(ffn_out, "ffn_out", il)
        cur = ops.add(ops.add(cur, ffn_out), inpL)
        inpL = g.cb(cur, "l_out", il)

    g.build_output(inpL, type_norm=LLMNormType.NORM)
