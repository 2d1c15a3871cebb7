"""GLM-4 (GLM-4-0414 9B/32B, text): llama.cpp's src/models/glm4.cpp.

A pre-norm block with RMS norms, plus a norm after attention and after the FFN (before each
residual add, as Gemma 2); Q/K/V fused or separate with biases; NORM rope, usually over part
of each head (rope.dimension_count below the head size); the FFN's ffn_up holds [gate; up]
(SwiGLU, as Phi-3). GLM-4V's M-RoPE (rope.dimension_sections) is refused until rope_multi lands."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    sections = ml.get_key_or_arr(LLMKV.ROPE_DIMENSION_SECTIONS, int, 4, [0, 0, 0, 0])
    if any(sections):
        raise ml.error(f"'{ml.key_name(LLMKV.ROPE_DIMENSION_SECTIONS)}' = {list(sections)}: GLM-4V's M-RoPE "
                       "(ggml_rope_multi) is not supported yet; text-only GLM-4 files have no sections")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, hp.n_embd_head_k * hp.n_head(il), hp.n_embd_k_gqa(il),
                   hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (hp.n_embd_head_k * hp.n_head(il), n_embd), dev)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (hp.n_ff(il), n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, 2 * hp.n_ff(il)), dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
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
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)

        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "post_attn_norm", il)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, None, layer.ffn_down, LLMFfnOpType.SWIGLU, LLMFfnGateType.SEQ, il),
                   "ffn_out", il)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, il), "post_mlp_norm", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
