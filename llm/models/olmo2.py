"""OLMo 2: llama.cpp's src/models/olmo2.cpp.

No pre-norms: the attention and FFN outputs are RMS-normed before they join the residual
(post_attention_norm, post_ffw_norm); Q and K are RMS-normed over all heads at once (norm
weights [n_embd] and [n_embd_k_gqa]) before NEOX rope. Optional sliding-window layers
(every 4th layer global) rope with their own base and no scaling."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType, SWAType, load_swa_pattern
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int, 0)
    if hp.n_swa > 0:
        hp.swa_type = SWAType.STANDARD
        load_swa_pattern(hp, ml, 4)
        hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
        hp.rope_freq_scale_train_swa = 1.0
    else:
        hp.swa_type = SWAType.NONE


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_kv = hp.n_embd_k_gqa(il)
        create_qkv(layer, ml, il, dev, n_embd, n_embd, n_kv, hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (n_embd,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (n_kv,), dev)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        n_ff = hp.n_ff(il)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    d = hp.n_embd_head_k
    n_tokens = g.n_tokens

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        q, k, v = g.build_qkv(layer, inpL, il)
        # llama.cpp's olmo2 norms the 2-D projections and leaves their reshapes unnamed
        q.set_name("")
        k.set_name("")
        # Q/K norms span all heads: normalize [n_embd_head * n_head] rows, then split heads
        q = ops.reshape_2d(q, d * hp.n_head(il), n_tokens)
        k = ops.reshape_2d(k, d * hp.n_head_kv(il), n_tokens)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        q = ops.reshape_3d(q, d, hp.n_head(il), n_tokens)
        k = ops.reshape_3d(k, d, hp.n_head_kv(il), n_tokens)
        rope = g.rope_params(il)
        if hp.is_swa(il):
            rope.update(ext_factor=0.0, attn_factor=1.0)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **rope), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **rope), "Kcur", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, 1.0 / math.sqrt(d), il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_ffn(ffn_inp, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                               LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_out", il)
        # llama.cpp names these with il = -1: "norm" and "ffn_post_norm" (kept for the diff)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, -1), "ffn_post_norm")
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
