"""Qwen2-VL's text tower: llama.cpp's src/models/qwen2vl.cpp.

Qwen2's block (llm/models/qwen2.py: RMS norms, Q/K/V with biases, SiLU-gated FFN) with M-RoPE
(rope_multi): each rotated pair takes the t, h or w position of its section
(`rope.dimension_sections`); text tokens sit at (p, p, p, 0), images (the multimodal issue) at
their grid positions."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_ffn, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_mrope_sections(hp: HParams, ml: GGUFMeta) -> None:
    """`rope.dimension_sections` (required): pairs per stream, at most the rotated pairs."""
    sections = ml.get_key_or_arr(LLMKV.ROPE_DIMENSION_SECTIONS, int, 4)
    if any(s < 0 for s in sections) or not any(sections[:3]) or sum(sections) > hp.n_rot // 2:
        raise ml.error(f"'{ml.key_name(LLMKV.ROPE_DIMENSION_SECTIONS)}' = {list(sections)} must be 4 counts >= 0 "
                       f"with t, h or w > 0, at most {hp.n_rot // 2} pairs in all")
    hp.rope_sections = (sections[0], sections[1], sections[2], sections[3])


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.MROPE
    # the file's epsilon, as Qwen2-VL was trained (llama.cpp 0.3.36's qwen2vl does not read this
    # key and normalizes with 0; the fixture's 1e-12 makes the two agree)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    if hp.n_rot != hp.n_embd_head_k:
        raise ml.error(f"invalid '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot}: "
                       f"Qwen2-VL rotates whole heads, expected {hp.n_embd_head_k}")
    load_mrope_sections(hp, ml)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        create_qkv(layer, ml, il, dev, hp.n_embd, hp.n_embd, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (hp.n_embd, hp.n_embd), dev)
        create_ffn(layer, ml, hp, il, dev)
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
        q = g.cb(ops.rope_multi(q, inp_pos, None, **g.rope_multi_params(il)), "Qcur", il)
        k = g.cb(ops.rope_multi(k, inp_pos, None, **g.rope_multi_params(il)), "Kcur", il)

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
