"""SmolLM3: llama.cpp's src/models/smollm3.cpp.

The llama block (RMS pre-norms, NORM rope, GQA, SiLU-gated FFN) where every 4th layer
(il % 4 == 3) uses no positional encoding at all (NoPE)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_attn, create_embd_output, create_ffn
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model

NO_ROPE_LAYER_STEP = 4


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    # (llama.cpp keeps rope_pattern all-on for smollm3, so its K-shift also rotates the NoPE
    # layers' cached keys; here a shift leaves them alone, as their attention has no positions)
    hp.rope_layers = [(il + 1) % NO_ROPE_LAYER_STEP != 0 for il in range(hp.n_layer)]


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
        create_ffn(layer, ml, hp, il, dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_k)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        if hp.has_rope(il):
            q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
            k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                               LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
