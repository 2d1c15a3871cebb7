"""LFM2: llama.cpp's src/models/lfm2.cpp (the graph is lfm2moe's too).

Short-convolution layers (no KV heads) and attention layers with RMS-normed Q and K and
NEOX rope, each followed by a gated FFN. A short-conv block projects to three chunks b, c,
x, convolves b * x causally over the sequence with a per-channel kernel of width
`shortconv.l_cache` (ggml's ssm_conv, continuing the sequence's conv state), gates the
result by c and projects back. The context holds a hybrid memory: a KV cache for the
attention layers, each sequence's last l_cache - 1 columns of b * x for the conv layers (no
SSM state). The output norm is the tensor llama.cpp reads as `token_embd_norm`. The names
are llama.cpp's, Hugging Face module paths with `{}` for the layer
(`model.layers.{}.conv.in_proj-3`). Layers from `n_layer_dense_lead` on route to a
mixture of experts instead of the dense FFN (lfm2moe; in LFM2 every layer is dense)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, InpAttnKV, InpRS, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType, SWAType
from llm.layer import Layer, create_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from ggmlx.tensor import Tensor
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    load_shortconv_hparams(hp, ml)
    hp.n_layer_dense_lead = hp.n_layer      # every layer dense
    check_ffn(hp, ml)


def load_shortconv_hparams(hp: HParams, ml: GGUFMeta) -> None:
    """The keys LFM2 and LFM2-MoE share: the conv width, the norm epsilon, which layers are
    convolutions (no KV heads), an optional sliding window on the attention layers."""
    hp.rope_type = RopeType.NEOX
    hp.n_shortconv_l_cache = ml.get_key(LLMKV.SHORTCONV_L_CACHE, int)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    if hp.n_shortconv_l_cache < 2:       # llama.cpp asserts it: the state holds l_cache - 1 columns
        raise ml.error(f"'{ml.key_name(LLMKV.SHORTCONV_L_CACHE)}' = {hp.n_shortconv_l_cache} must be at least 2")
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int, 0)
    if hp.n_swa > 0:
        hp.swa_type = SWAType.STANDARD
        hp.swa_layers = [not r for r in hp.recurrent_layers]


def check_ffn(hp: HParams, ml: GGUFMeta) -> None:
    """Dense layers need an FFN width, attention layers n_head heads of n_embd."""
    for il in range(hp.n_layer):
        if il < hp.n_layer_dense_lead and hp.n_ff(il) <= 0:
            raise ml.error(f"layer {il}: '{ml.key_name(LLMKV.FEED_FORWARD_LENGTH)}' = {hp.n_ff(il)} must be positive")
        if not hp.is_recurrent(il) and hp.n_embd_head_k * hp.n_head(il) != hp.n_embd:
            raise ml.error(f"layer {il}: {hp.n_head(il)} heads of {hp.n_embd_head_k} must make n_embd = {hp.n_embd} "
                           f"('{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT)}')")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (n_embd, hp.n_vocab), model.place.dev_input)
    create_output(model, ml, n_embd, hp.n_vocab, norm=T.TOKEN_EMBD_NORM)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        if il >= hp.n_layer_dense_lead:
            n_ff, n_exp = hp.n_ff_exp, hp.n_expert
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_exp_probs_b = ml.create_tensor(tn(T.FFN_EXP_PROBS_B, "bias", il), (n_exp,), dev)
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        if not hp.is_recurrent(il):
            layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k,), dev)
            layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (hp.n_embd_head_k,), dev)
            create_qkv(layer, ml, il, dev, n_embd, n_embd, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
            layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
        else:
            layer.shortconv_conv = ml.create_tensor(tn(T.SHORTCONV_CONV, "weight", il),
                                                    (hp.n_shortconv_l_cache, n_embd), dev)
            layer.shortconv_in_proj = ml.create_tensor(tn(T.SHORTCONV_INPROJ, "weight", il), (n_embd, 3 * n_embd), dev)
            layer.shortconv_out_proj = ml.create_tensor(tn(T.SHORTCONV_OUTPROJ, "weight", il), (n_embd, n_embd), dev)
        model.layers.append(layer)


def build_attn_block(g: GraphBuilder, cur: Tensor, inp_pos: Tensor, inp_attn: InpAttnKV, layer: Layer,
                     il: int) -> Tensor:
    hp = g.hparams
    q, k, v = g.build_qkv(layer, cur, il)
    q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "model.layers.{}.self_attn.q_layernorm", il)
    k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "model.layers.{}.self_attn.k_layernorm", il)
    q = ops.rope_ext(q, inp_pos, None, **g.rope_params(il))
    k = ops.rope_ext(k, inp_pos, None, **g.rope_params(il))
    cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_v), il)
    return g.cb(cur, "model.layers.{}.self_attn.out_proj", il)


def build_shortconv_block(g: GraphBuilder, cur: Tensor, inp: InpRS, layer: Layer, il: int) -> Tensor:
    """cur [n_embd, n_tokens] -> [n_embd, n_tokens]; the sequence's conv state is read and
    its last l_cache - 1 columns of b * x written back."""
    hp, rs = g.hparams, g.rs
    assert rs is not None       # build_rs_inp checked
    conv_state = rs.r_l[il]
    assert conv_state is not None       # the memory holds every recurrent layer
    n_embd, d_conv = hp.n_embd, hp.n_shortconv_l_cache - 1
    n_seqs = g.params.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    cur = ops.reshape_3d(cur, cur.ne[0], n_seq_tokens, n_seqs)
    bcx = g.cb(g.build_lora_mm(g.need(layer.shortconv_in_proj, "shortconv.in_proj", il), cur),
               "model.layers.{}.conv.in_proj", il)
    chunk = bcx.ne[0] // 3
    b, c, x = (ops.view_3d(bcx, chunk, bcx.ne[1], bcx.ne[2], bcx.nb[1], bcx.nb[2], i * chunk * bcx.nb[0])
               for i in range(3))
    bx = ops.transpose(ops.mul(b, x))
    conv = ops.reshape_3d(g.build_rs(inp, conv_state, hp.n_embd_r()), d_conv, n_embd, n_seqs)
    bx = ops.concat(conv, bx, 0)                                        # [d_conv + T, n_embd, S]
    conv_snap = ops.view_3d(bx, d_conv, bx.ne[1], bx.ne[2], bx.nb[1], bx.nb[2], (bx.ne[0] - d_conv) * bx.nb[0])
    g.write_rs(conv_state, ops.reshape_2d(ops.cont(conv_snap), hp.n_embd_r(), n_seqs), inp)
    conv_out = g.cb(ops.ssm_conv(bx, g.need(layer.shortconv_conv, "shortconv.conv", il)),
                    "model.layers.{}.conv.conv", il)
    y = ops.mul(c, conv_out)
    y = g.cb(g.build_lora_mm(g.need(layer.shortconv_out_proj, "shortconv.out_proj", il), y),
             "model.layers.{}.conv.out_proj", il)
    return ops.reshape_2d(y, y.ne[0], n_seq_tokens * n_seqs)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    cur = g.cb(g.build_inp_embd(m.tok_embd), "model.embed_tokens")
    inp_attn = g.build_attn_inp_kv()
    inp_rs = g.build_rs_inp()
    inp_pos = g.build_inp_pos()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        prev_cur = cur
        cur = g.cb(g.build_norm(cur, layer.attn_norm, None, LLMNormType.RMS, il), "model.layers.{}.operator_norm", il)
        if hp.is_recurrent(il):
            cur = build_shortconv_block(g, cur, inp_rs, layer, il)
        else:
            cur = build_attn_block(g, cur, inp_pos, inp_attn, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            prev_cur = ops.get_rows(prev_cur, inp_out_ids)
        cur = ops.add(prev_cur, cur)
        ffn_norm_out = g.cb(g.build_norm(cur, layer.ffn_norm, None, LLMNormType.RMS, il),
                            "model.layers.{}.ffn_norm", il)
        if il >= hp.n_layer_dense_lead:
            ffn_out = g.build_moe_ffn(ffn_norm_out, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                      layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True,
                                      ExpertGatingFuncType(hp.expert_gating_func), il,
                                      exp_probs_b=layer.ffn_exp_probs_b, w_scale=hp.expert_weights_scale)
        else:
            ffn_out = g.build_ffn(ffn_norm_out, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                                  LLMFfnGateType.PAR, il)
        g.cb(ffn_norm_out, "model.layers.{}.ffn_out", il)      # llama.cpp renames the FFN's input so
        cur = g.cb(ops.add(cur, ffn_out), "l_out", il)

    g.build_output(cur)
