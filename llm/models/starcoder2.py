"""StarCoder 2: llama.cpp's src/models/starcoder2.cpp.

Pre-norm blocks with LayerNorm (weight and bias), NEOX rope, GQA with optional Q/K/V biases
and an output bias, and a sequential GELU FFN with biases; LayerNorm before the output."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_ln_block, create_ln_output
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_ln_output(model, ml)
    for il in range(hp.n_layer):
        layer = Layer()
        create_ln_block(layer, ml, hp, il, model.place.dev_layer[il], ffn_norm=True)
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
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, layer.attn_norm_b, LLMNormType.NORM, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, layer.ffn_norm_b, LLMNormType.NORM, il), "ffn_norm", il)
        cur = g.build_ffn(cur, layer.ffn_up, None, layer.ffn_down, LLMFfnOpType.GELU, LLMFfnGateType.SEQ, il,
                          up_b=layer.ffn_up_b, down_b=layer.ffn_down_b)
        g.cb(cur, "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL, type_norm=LLMNormType.NORM)
