"""Qwen3-VL's text tower: llama.cpp's src/models/qwen3vl.cpp.

Qwen3's block (RMS-normed query and key heads before rope, no biases) with Qwen3-VL's
interleaved M-RoPE (IMROPE: rotated pairs cycle through the t, h and w positions; the pairs
past 3 x each section take the 4th stream, 0 for text, and stay unrotated). DeepStack adds a
slice of an image token's wider input embedding to the first `n_deepstack_layers` layer
outputs; a text token's slices are zero (llama.cpp pads its embedding with zeros), so text
adds nothing, and an image's embeddings (llm.mtmd's qwen3vl_merger) come n_embd_inp wide:
the model's own n_embd columns, then a slice per DeepStack layer."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from ggmlx.tensor import Tensor
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_embd_output, create_ffn, create_qkv
from llm.loader import GGUFMeta, ModelLoader
from llm.models.qwen2vl import load_mrope_sections

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.IMROPE
    hp.n_deepstack_layers = ml.get_key(LLMKV.NUM_DEEPSTACK_LAYERS, int, 0)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    if hp.n_rot != hp.n_embd_head_k:
        raise ml.error(f"invalid '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot}: "
                       f"Qwen3-VL rotates whole heads, expected {hp.n_embd_head_k}")
    load_mrope_sections(hp, ml)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_embd_head_k * hp.n_head(il)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        create_qkv(layer, ml, il, dev, hp.n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, hp.n_embd), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        create_ffn(layer, ml, hp, il, dev)
        model.layers.append(layer)


def add_deepstack(g: GraphBuilder, cur: Tensor, il: int) -> Tensor:
    """After layer il < n_deepstack_layers, an image token's (il + 1)-th slice of its input
    embedding (a text token's would be zeros, so token batches add nothing)."""
    embd, hp = g.t_inp_embd, g.hparams
    if il >= hp.n_deepstack_layers or embd is None:
        return cur
    ds = ops.view_2d(embd, hp.n_embd, g.n_tokens, embd.nb[1], (il + 1) * hp.n_embd * embd.nb[0])
    return g.cb(ops.add(cur, ds), "deepstack_out", il)


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
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        q = g.cb(ops.rope_multi(q, inp_pos, None, **g.rope_multi_params(il)), "Qcur", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        k = g.cb(ops.rope_multi(k, inp_pos, None, **g.rope_multi_params(il)), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                               LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_out", il)
        inpL = add_deepstack(g, g.cb(ops.add(cur, ffn_inp), "l_out", il), il)

    g.build_output(inpL)
