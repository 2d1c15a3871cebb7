"""Gemma 2: llama.cpp's src/models/gemma2.cpp.

Embeddings scaled by sqrt(n_embd); sliding-window and global layers alternating; attention
logits soft-capped; post-attention and post-FFN norms; a GELU-gated FFN; final logits
soft-capped; tied output embeddings."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType, SWAType
from llm.layer import Layer, create_attn, create_embd_output, create_ffn
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.swa_type = SWAType.STANDARD
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int, 4096)
    hp.set_swa_pattern(2)
    hp.attn_soft_cap = True
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.f_attn_logit_softcapping = ml.get_key(LLMKV.ATTN_LOGIT_SOFTCAPPING, float, 50.0)
    hp.f_final_logit_softcapping = ml.get_key(LLMKV.FINAL_LOGIT_SOFTCAPPING, float, 30.0)
    # queries are scaled by 1/sqrt(head size), except in the 27B model (46 layers): n_embd / n_head
    is_27b = hp.n_layer == 46
    hp.f_attention_scale = 1.0 / math.sqrt(float(hp.n_embd // hp.n_head(0) if is_27b else hp.n_embd_head_k))


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        create_ffn(layer, ml, hp, il, dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams

    inpL = g.build_inp_embd(m.tok_embd)
    inpL = g.cb(ops.scale(inpL, 1.0 if g.params.embd_input else math.sqrt(hp.n_embd)), "inp_scaled")
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    softcap = hp.f_attn_logit_softcapping if hp.attn_soft_cap else 0.0

    for il in range(hp.n_layer):
        layer = m.layers[il]
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
        k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        q = g.cb(ops.scale(q, hp.f_attention_scale), "Qcur_scaled", il)

        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, 1.0, il, softcap=softcap)
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
        sa_out = g.cb(ops.add(cur, inpL), "sa_out", il)

        cur = g.cb(g.build_norm(sa_out, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                               LLMFfnOpType.GELU, LLMFfnGateType.PAR, il), "ffn_out", il)
        # llama.cpp names these with il = -1: "norm" and "ffn_post_norm" (kept for the diff)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, -1), "ffn_post_norm")
        inpL = g.cb(ops.add(cur, sa_out), "l_out", il)

    g.build_output(inpL, final_softcap=hp.f_final_logit_softcapping)
