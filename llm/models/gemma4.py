"""Gemma 4: llama.cpp's src/models/gemma4.cpp.

Gemma 3's block (scaled embeddings, RMS-normed Q and K, post-attention and post-FFN norms,
GELU-gated FFN) with sliding-window layers told apart by a per-layer pattern, and per-layer
sizes: full layers have larger heads (their own K/V head count and FFN width may differ)
and a "proportional" rope whose rope_freqs leave most of each head unrotated. Values are
RMS-normed without weight (from K when a layer has no V projection), Q is not scaled. The
small models add Gemma 3n's per-layer embeddings (a token lookup plus a projection of the
input embedding, gating a correction after each layer) and share the last layers' KV caches;
the MoE model runs a dense FFN and routed experts side by side, the router reading the
normed residual. Each layer's output may be scaled by a learned scalar."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from ggmlx.tensor import Tensor
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, InpEmbd, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType, SWAType
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.swa_type = SWAType.STANDARD
    pattern = ml.get_arr(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN, bool)
    if len(pattern) != hp.n_layer:
        raise ml.error(f"'{ml.key_name(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN)}' has {len(pattern)} values, "
                       f"expected one per layer ({hp.n_layer})")
    hp.swa_layers = list(pattern)
    n_kv_shared_layers = ml.get_key(LLMKV.ATTENTION_SHARED_KV_LAYERS, int, 0)
    # llama.cpp's layer_reuse needs a sliding-window and a full layer with a cache before the shared ones
    if not 0 <= n_kv_shared_layers <= hp.n_layer - 2:
        raise ml.error(f"'{ml.key_name(LLMKV.ATTENTION_SHARED_KV_LAYERS)}' = {n_kv_shared_layers} must be in "
                       f"[0, {hp.n_layer - 2}] (block_count - 2)")
    hp.n_layer_kv_from_start = hp.n_layer - n_kv_shared_layers
    hp.f_attention_scale = 1.0       # Gemma 4 does not scale the queries
    hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, 10000.0)
    hp.rope_freq_scale_train_swa = 1.0
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer, [0] * hp.n_layer)[0]
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_embd_per_layer = ml.get_key(LLMKV.EMBEDDING_LENGTH_PER_LAYER, int)
    hp.n_embd_head_k_swa = ml.get_key(LLMKV.ATTENTION_KEY_LENGTH_SWA, int)
    hp.n_embd_head_v_swa = ml.get_key(LLMKV.ATTENTION_VALUE_LENGTH_SWA, int)
    hp.f_final_logit_softcapping = ml.get_key(LLMKV.FINAL_LOGIT_SOFTCAPPING, float, 30.0)
    if hp.n_embd_head_k != hp.n_embd_head_v or hp.n_embd_head_k_swa != hp.n_embd_head_v_swa:
        raise ml.error(f"Gemma 4 needs equal key and value head sizes: '{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH)}' "
                       f"{hp.n_embd_head_k} / {hp.n_embd_head_v}, '{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH_SWA)}' "
                       f"{hp.n_embd_head_k_swa} / {hp.n_embd_head_v_swa}")
    if not hp.causal_attn:
        # llama.cpp then attends bidirectionally in the sliding-window layers only
        raise ml.error(f"'{ml.key_name(LLMKV.ATTENTION_CAUSAL)}' = false (bidirectional sliding-window layers) "
                       f"is not supported for gemma4")
    for il in range(hp.n_layer):
        if hp.is_swa(il) != hp.is_swa(hp.kv_layer(il)):
            raise ml.error(f"layer {il} shares the KV cache of layer {hp.kv_layer(il)}, which is "
                           f"{'not ' if hp.is_swa(il) else ''}a sliding-window layer: "
                           f"'{ml.key_name(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN)}' does not fit the shared layers")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_embd_per_layer, n_ff_exp, n_expert = hp.n_embd, hp.n_embd_per_layer, hp.n_ff_exp, hp.n_expert
    pl = model.place
    create_embd_output(model, ml)
    if n_embd_per_layer > 0:
        model.per_layer_tok_embd = ml.create_tensor(tn(T.PER_LAYER_TOKEN_EMBD, "weight"),
                                                    (n_embd_per_layer * hp.n_layer, hp.n_vocab), pl.dev_input)
        model.per_layer_model_proj = ml.create_tensor(tn(T.PER_LAYER_MODEL_PROJ, "weight"),
                                                      (n_embd, n_embd_per_layer * hp.n_layer), pl.dev_layer[0])
        model.per_layer_proj_norm = ml.create_tensor(tn(T.PER_LAYER_PROJ_NORM, "weight"), (n_embd_per_layer,),
                                                     pl.dev_layer[0])
    rope_freqs_flag = TensorFlag.NONE
    for il in range(hp.n_layer):
        dev = pl.dev_layer[il]
        layer = Layer()
        n_embd_head, n_head = hp.n_embd_head_k_l(il), hp.n_head(il)
        n_embd_k, n_embd_v = hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        kv_flags = TensorFlag.NONE if hp.has_kv(il) else TensorFlag.NOT_REQUIRED
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        # V is optional (use_alternative_attention: V from the K projection)
        n_qkv = n_embd_head * n_head + n_embd_k + n_embd_v
        layer.wqkv = ml.create_tensor(tn(T.ATTN_QKV, "weight", il), (n_embd, n_qkv), dev, TensorFlag.NOT_REQUIRED)
        if layer.wqkv is None:
            layer.wq = ml.create_tensor(tn(T.ATTN_Q, "weight", il), (n_embd, n_embd_head * n_head), dev)
            layer.wk = ml.create_tensor(tn(T.ATTN_K, "weight", il), (n_embd, n_embd_k), dev, kv_flags)
            layer.wv = ml.create_tensor(tn(T.ATTN_V, "weight", il), (n_embd, n_embd_v), dev, TensorFlag.NOT_REQUIRED)
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd_head * n_head, n_embd), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (n_embd_head,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (n_embd_head,), dev, kv_flags)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        layer.out_scale = ml.create_tensor(tn(T.LAYER_OUT_SCALE, "weight", il), (1,), dev, TensorFlag.NOT_REQUIRED)
        if not hp.is_swa(il):       # the full layers' proportional rope
            layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (n_embd_head // 2,), dev,
                                                rope_freqs_flag)
            rope_freqs_flag = TensorFlag.DUPLICATED
        n_ff = hp.n_ff(il)
        # in an expert layer this dense FFN runs beside the experts
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_expert), dev,
                                              TensorFlag.NOT_REQUIRED)
        if layer.ffn_gate_inp is not None:
            layer.ffn_gate_inp_s = ml.create_tensor(tn(T.FFN_GATE_INP, "scale", il), (n_embd,), dev)
            layer.ffn_pre_norm_2 = ml.create_tensor(tn(T.FFN_PRE_NORM_2, "weight", il), (n_embd,), dev)
            layer.ffn_post_norm_1 = ml.create_tensor(tn(T.FFN_POST_NORM_1, "weight", il), (n_embd,), dev)
            layer.ffn_post_norm_2 = ml.create_tensor(tn(T.FFN_POST_NORM_2, "weight", il), (n_embd,), dev)
            layer.ffn_gate_up_exps = ml.create_tensor(tn(T.FFN_GATE_UP_EXPS, "weight", il),
                                                      (n_embd, n_ff_exp * 2, n_expert), dev, TensorFlag.NOT_REQUIRED)
            if layer.ffn_gate_up_exps is None:
                layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff_exp, n_expert),
                                                       dev)
                layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff_exp, n_expert), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff_exp, n_embd, n_expert), dev)
            # the router's per-expert scale (llama.cpp's generic pass loads it as ffn_down_exps_s)
            layer.ffn_down_exps_s = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "scale", il), (n_expert,), dev,
                                                     TensorFlag.NOT_REQUIRED)
        if n_embd_per_layer > 0:
            layer.per_layer_inp_gate = ml.create_tensor(tn(T.PER_LAYER_INP_GATE, "weight", il),
                                                        (n_embd, n_embd_per_layer), dev)
            layer.per_layer_proj = ml.create_tensor(tn(T.PER_LAYER_PROJ, "weight", il), (n_embd_per_layer, n_embd), dev)
            layer.per_layer_post_norm = ml.create_tensor(tn(T.PER_LAYER_POST_NORM, "weight", il), (n_embd,), dev)
        model.layers.append(layer)


# ---- graph -------------------------------------------------------------------------------------


def build_inp_per_layer(g: GraphBuilder) -> Tensor:
    """Each token's per-layer embeddings [n_embd_per_layer, n_layer, n_tokens], scaled by
    sqrt(n_embd_per_layer); a second token input, as llama.cpp's."""
    m, hp = g.model, g.hparams
    if g.params.embd_input:
        raise ValueError("gemma4: an embeddings input (images, audio) has no token ids for the per-layer "
                         "embeddings; only token input is supported")
    inp = InpEmbd(g.params, hp.n_embd)
    g.inputs.append(inp)
    assert inp.tokens is not None       # a token input (embd_input is refused above)
    cur = ops.get_rows(g.need(m.per_layer_tok_embd, "per_layer_token_embd"), inp.tokens)
    cur = ops.reshape_3d(cur, hp.n_embd_per_layer, hp.n_layer, g.n_tokens)
    return g.cb(ops.scale(cur, math.sqrt(hp.n_embd_per_layer)), "inp_per_layer_selected")


def project_per_layer_inputs(g: GraphBuilder, inp_batch: Tensor, inp_per_layer: Tensor) -> Tensor:
    """The per-layer inputs: the projected input embedding, normed, plus the lookup, both
    scaled by 1/sqrt(2) -> [n_embd_per_layer, n_tokens, n_layer]."""
    m, hp = g.model, g.hparams
    proj = ops.mul_mat(g.need(m.per_layer_model_proj, "per_layer_model_proj"), inp_batch)
    proj = ops.reshape_3d(ops.scale(proj, 1.0 / math.sqrt(hp.n_embd)), hp.n_embd_per_layer, hp.n_layer, g.n_tokens)
    proj = g.cb(g.build_norm(proj, m.per_layer_proj_norm, None, LLMNormType.RMS, -1), "per_layer_proj")
    cur = g.cb(ops.scale(ops.add(proj, inp_per_layer), 1.0 / math.sqrt(2.0)), "inp_per_layer")
    return ops.cont(ops.permute(cur, 0, 2, 1, 3))


def build_moe_block(g: GraphBuilder, layer: Layer, attn_out: Tensor, il: int) -> Tensor:
    """The dense FFN (the shared expert) and the routed experts, each with its own norms; the
    router reads the residual, RMS-normed, scaled by 1/sqrt(n_embd) and per channel."""
    hp = g.hparams
    cur_mlp = g.cb(g.build_norm(attn_out, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm_1", il)
    cur_mlp = g.build_ffn(cur_mlp, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                          LLMFfnOpType.GELU, LLMFfnGateType.PAR, il)
    cur_mlp = g.cb(g.build_norm(cur_mlp, layer.ffn_post_norm_1, None, LLMNormType.RMS, il), "ffn_mlp", il)

    cur_moe = g.cb(g.build_norm(attn_out, layer.ffn_pre_norm_2, None, LLMNormType.RMS, il), "ffn_norm_2", il)
    tmp = ops.rms_norm(attn_out, hp.f_norm_rms_eps)
    tmp = ops.scale(tmp, 1.0 / math.sqrt(hp.n_embd))
    tmp = ops.mul(tmp, g.need(layer.ffn_gate_inp_s, "ffn_gate_inp.scale", il))
    logits = g.cb(g.build_lora_mm(g.need(layer.ffn_gate_inp, "ffn_gate_inp", il), tmp), "ffn_moe_logits", il)
    cur_moe = g.build_moe_ffn(cur_moe, None, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                              hp.n_expert, hp.n_expert_used, LLMFfnOpType.GELU, True,
                              ExpertGatingFuncType.SOFTMAX, il, probs_in=logits,
                              gate_up_exps=layer.ffn_gate_up_exps, down_exps_s=layer.ffn_down_exps_s)
    cur_moe = g.cb(g.build_norm(cur_moe, layer.ffn_post_norm_2, None, LLMNormType.RMS, il), "ffn_moe", il)
    return g.cb(ops.add(cur_mlp, cur_moe), "ffn_moe_combined", il)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams

    inpL = g.build_inp_embd(m.tok_embd)
    # raw embeddings input (e.g. encoded images) is not scaled, as in llama.cpp
    inpL = g.cb(ops.scale(inpL, 1.0 if g.params.embd_input else math.sqrt(hp.n_embd)), "inp_scaled")
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    inp_per_layer = None
    if m.per_layer_tok_embd is not None:
        inp_per_layer = project_per_layer_inputs(g, inpL, build_inp_per_layer(g))

    for il in range(hp.n_layer):
        layer = m.layers[il]
        n_embd_head, n_head, n_head_kv = hp.n_embd_head_k_l(il), hp.n_head(il), hp.n_head_kv(il)
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        freq_factors = None if hp.is_swa(il) else layer.rope_freqs

        # Q for every layer; K and V only for the layers with a cache of their own
        q_dim = n_embd_head * n_head
        qkv = None
        if layer.wqkv is not None:
            qkv = g.cb(g.build_lora_mm(layer.wqkv, cur), "wqkv", il)
            q = ops.cont(ops.view_2d(qkv, q_dim, g.n_tokens, qkv.nb[1], 0))
        else:
            q = g.build_lora_mm(g.need(layer.wq, "attn_q", il), cur)
        q = g.cb(q, "Qcur", il)
        q = ops.reshape_3d(q, n_embd_head, n_head, g.n_tokens)
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        q = g.cb(ops.rope_ext(q, inp_pos, freq_factors, **g.rope_params(il)), "Qcur_pos", il)

        if hp.has_kv(il):
            if qkv is not None:
                k_dim = v_dim = n_embd_head * n_head_kv
                esz = qkv.nb[0]
                k = ops.cont(ops.view_2d(qkv, k_dim, g.n_tokens, qkv.nb[1], q_dim * esz))
                v = ops.cont(ops.view_2d(qkv, v_dim, g.n_tokens, qkv.nb[1], (q_dim + k_dim) * esz))
            else:
                k = g.build_lora_mm(g.need(layer.wk, "attn_k", il), cur)
                v = g.build_lora_mm(layer.wv, cur) if layer.wv is not None else k   # V from K without attn_v
            k = g.cb(k, "Kcur", il)
            v = g.cb(v, "Vcur", il)
            k = ops.reshape_3d(k, n_embd_head, n_head_kv, g.n_tokens)
            v = ops.reshape_3d(v, n_embd_head, n_head_kv, g.n_tokens)
            k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
            v = g.cb(ops.rms_norm(v, hp.f_norm_rms_eps), "Vcur_normed", il)
            k = g.cb(ops.rope_ext(k, inp_pos, freq_factors, **g.rope_params(il)), "Kcur_pos", il)
            cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, hp.f_attention_scale, il)
        else:   # attends to the cache of hp.kv_layer(il)
            cur = g.build_attn(inp_attn, layer.wo, None, q, None, None, hp.f_attention_scale, il)

        cur.set_name("")        # llama.cpp leaves the wo product unnamed: attn_out is the residual below
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        attn_out = g.cb(ops.add(cur, inpL), "attn_out", il)

        if layer.ffn_gate_inp is not None:
            cur = build_moe_block(g, layer, attn_out, il)
        else:
            cur = g.cb(g.build_norm(attn_out, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                                   LLMFfnOpType.GELU, LLMFfnGateType.PAR, il), "ffn_out", il)
        # llama.cpp norms this with il = -1, so its inner node is named "norm" (kept for the diff)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, -1), "ffn_post_norm", il)
        cur = ops.add(cur, attn_out)

        if inp_per_layer is not None:
            # the layer's per-layer input, gated by the layer's output, added back
            pe_in = g.cb(cur, "pe_in", il)
            cur = g.build_lora_mm(g.need(layer.per_layer_inp_gate, "inp_gate", il), cur)
            cur = ops.gelu(cur)
            inp_this_layer = ops.view_2d(inp_per_layer, inp_per_layer.ne[0], inp_per_layer.ne[1],
                                         inp_per_layer.nb[1], il * inp_per_layer.nb[2])
            cur = ops.mul(cur, inp_this_layer)
            cur = g.build_lora_mm(g.need(layer.per_layer_proj, "proj", il), cur)
            cur = g.cb(g.build_norm(cur, layer.per_layer_post_norm, None, LLMNormType.RMS, il),
                       "per_layer_embd_out", il)
            cur = ops.add(pe_in, cur)

        if layer.out_scale is not None:
            cur = g.cb(ops.mul(cur, layer.out_scale), "out_scaled", il)
        inpL = g.cb(cur, "l_out", il)

    # llama.cpp keeps every row to the output norm (the MTP drafter reads them), then the outputs
    cur = inpL
    if inp_out_ids is not None:
        cur = ops.get_rows(cur, inp_out_ids)
    g.build_output(cur, final_softcap=hp.f_final_logit_softcapping)
