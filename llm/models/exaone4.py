"""EXAONE 4.0 (1.2B, 32B): llama.cpp's src/models/exaone4.cpp.

A post-norm block: no norm before attention or the FFN, an RMS norm after each (before its
residual add); Q and K heads RMS-normed before rope. The 64-layer model slides a 4096-token
window in 3 of every 4 layers and ropes only those (the global layers have no positional
encoding); smaller ones rope every layer. NextN blocks after the trunk are claimed, not run."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType, SWAType, load_swa_pattern
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model

SWA_LAYERS = 64         # llama.cpp: only the 32B (64 layers) uses sliding windows
SWA_DEFAULT, SWA_PATTERN = 4096, 4


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.drop_nextn_layers(ml.get_key(LLMKV.NEXTN_PREDICT_LAYERS, int, 0))
    if hp.n_layer == SWA_LAYERS:
        hp.swa_type = SWAType.STANDARD
        hp.n_swa = SWA_DEFAULT
        load_swa_pattern(hp, ml, SWA_PATTERN)
        hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
        hp.rope_freq_scale_train_swa = hp.rope_freq_scale_train
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int, hp.n_swa)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    if hp.n_rot != hp.n_embd_head_k:
        raise ml.error(f"invalid '{ml.key_name(LLMKV.ROPE_DIMENSION_COUNT)}' = {hp.n_rot}: "
                       f"EXAONE 4 rotates whole heads, expected {hp.n_embd_head_k}")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        n_q = hp.n_embd_head_k * hp.n_head(il)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
        flags = TensorFlag.NOT_REQUIRED | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, hp.n_ff(il)), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (hp.n_ff(il), n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, hp.n_ff(il)), dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
        model.layers.append(layer)
    for il in range(hp.n_layer, hp.n_layer + hp.n_layer_nextn):
        ml.skip_tensors(f"blk.{il}.")


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
        use_rope = hp.is_swa(il) or hp.swa_type == SWAType.NONE
        q, k, v = g.build_qkv(layer, inpL, il)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        if use_rope:
            q = ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il))
            k = ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il))
        q, k = g.cb(q, "Qcur", il), g.cb(k, "Kcur", il)
        cur = g.cb(g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il), "attn_out", il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.build_ffn(ffn_inp, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                               LLMFfnGateType.PAR, il), "ffn_out", il)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, -1), "ffn_post_norm")
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
