"""Gemma 3n: llama.cpp's src/models/gemma3n.cpp.

Gemma 3's block (RMS-normed Q and K, post-attention and post-FFN norms, GELU-gated FFN,
sliding-window layers with their own rope base) inside four AltUp streams: each layer
predicts all streams from the active one, runs attention and the FFN on it, and corrects
the others by the innovation. Laurel adds a low-rank residual beside attention; each
layer's per-layer embedding (a token lookup plus a projection of the input embedding)
gates the correction back in. The first layers keep only the activations above mean +
1.645 std of the FFN gate (activation sparsity). Values are RMS-normed without weight and
Q is not scaled. Only the first 20 layers have a KV cache: the later ones attend to the
last sliding-window or full layer's (HParams.kv_layer)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from ggmlx.tensor import Tensor
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, InpEmbd, LLMNormType
from llm.hparams import HParams, RopeType, SWAType, load_swa_pattern
from llm.layer import Layer, create_embd_output, create_qkv
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model

N_LAYER_SPARSITY = 10                     # layers whose FFN gate is sparsified
SPARSITY_STD_MUL = 1.6448533535003662     # the standard normal's 0.95 quantile


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.swa_type = SWAType.STANDARD
    load_swa_pattern(hp, ml, 5)
    hp.n_layer_kv_from_start = 20
    hp.f_attention_scale = 1.0
    hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    for il in range(hp.n_layer):
        if hp.is_swa(il) != hp.is_swa(hp.kv_layer(il)):
            raise ml.error(f"layer {il} shares the KV cache of layer {hp.kv_layer(il)}, which is "
                           f"{'not ' if hp.is_swa(il) else ''}a sliding-window layer: "
                           f"'{ml.key_name(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN)}' does not fit Gemma 3n")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd, n_altup, n_embd_altup, d_k = hp.n_embd, hp.n_altup, hp.n_embd_altup, hp.n_embd_head_k
    pl = model.place
    create_embd_output(model, ml)
    model.altup_proj = ml.create_tensor(tn(T.ALTUP_PROJ, "weight"), (n_embd, n_embd, n_altup - 1), pl.dev_output)
    model.altup_unembd_proj = ml.create_tensor(tn(T.ALTUP_UNEMBD_PROJ, "weight"), (n_embd, n_embd, n_altup - 1),
                                               pl.dev_output)
    model.per_layer_tok_embd = ml.create_tensor(tn(T.PER_LAYER_TOKEN_EMBD, "weight"),
                                                (n_embd_altup * hp.n_layer, hp.n_vocab), pl.dev_input)
    model.per_layer_model_proj = ml.create_tensor(tn(T.PER_LAYER_MODEL_PROJ, "weight"),
                                                  (n_embd, n_embd_altup * hp.n_layer), pl.dev_layer[0])
    model.per_layer_proj_norm = ml.create_tensor(tn(T.PER_LAYER_PROJ_NORM, "weight"), (n_embd_altup,),
                                                 pl.dev_layer[0])
    for il in range(hp.n_layer):
        dev = pl.dev_layer[il]
        layer = Layer()
        n_q = d_k * hp.n_head(il)
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (n_embd,), dev)
        create_qkv(layer, ml, il, dev, n_embd, n_q, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_q, n_embd), dev)
        layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (d_k,), dev)
        layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il), (d_k,), dev)
        layer.attn_post_norm = ml.create_tensor(tn(T.ATTN_POST_NORM, "weight", il), (n_embd,), dev)
        n_ff = hp.n_ff(il)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_post_norm = ml.create_tensor(tn(T.FFN_POST_NORM, "weight", il), (n_embd,), dev)
        layer.per_layer_inp_gate = ml.create_tensor(tn(T.PER_LAYER_INP_GATE, "weight", il), (n_embd, n_embd_altup), dev)
        layer.per_layer_proj = ml.create_tensor(tn(T.PER_LAYER_PROJ, "weight", il), (n_embd_altup, n_embd), dev)
        layer.per_layer_post_norm = ml.create_tensor(tn(T.PER_LAYER_POST_NORM, "weight", il), (n_embd,), dev)
        layer.altup_correct_coef = ml.create_tensor(tn(T.ALTUP_CORRECT_COEF, "weight", il), (n_altup, n_altup), dev)
        layer.altup_correct_scale = ml.create_tensor(tn(T.ALTUP_CORRECT_SCALE, "weight", il), (n_embd,), dev)
        layer.altup_predict_coef = ml.create_tensor(tn(T.ALTUP_PREDICT_COEF, "weight", il),
                                                    (n_altup, n_altup * n_altup), dev)
        layer.altup_router = ml.create_tensor(tn(T.ALTUP_ROUTER, "weight", il), (n_embd, n_altup), dev)
        layer.altup_router_norm = ml.create_tensor(tn(T.ALTUP_ROUTER_NORM, "weight", il), (n_embd,), dev)
        layer.laurel_l = ml.create_tensor(tn(T.LAUREL_L, "weight", il), (n_embd, hp.laurel_rank), dev)
        layer.laurel_r = ml.create_tensor(tn(T.LAUREL_R, "weight", il), (hp.laurel_rank, n_embd), dev)
        layer.laurel_post_norm = ml.create_tensor(tn(T.LAUREL_POST_NORM, "weight", il), (n_embd,), dev)
        model.layers.append(layer)


# ---- graph -------------------------------------------------------------------------------------


def stream(x: Tensor, i: int) -> Tensor:
    """AltUp stream i of x [n_embd, n_tokens, n_altup] (or any slice along dim 2)."""
    return ops.view_2d(x, x.ne[0], x.ne[1], x.nb[1], i * x.nb[2])


def streams_from(x: Tensor, i: int) -> Tensor:
    """Streams i.. of x [n_embd, n_tokens, n_altup]."""
    return ops.view_3d(x, x.ne[0], x.ne[1], x.ne[2] - i, x.nb[1], x.nb[2], i * x.nb[2])


def repeat_streams(x: Tensor, n: int) -> Tensor:
    """x [n_embd, n_tokens] tiled n times along dim 2 (ggml_repeat_4d)."""
    out = x
    for _ in range(n - 1):
        out = ops.concat(out, x, 2)
    return out


def magnitude(x: Tensor) -> Tensor:
    """The L2 norm of each row."""
    return ops.sqrt(ops.sum_rows(ops.sqr(x)))


def build_inp_per_layer(g: GraphBuilder) -> Tensor:
    """Each token's per-layer embeddings [n_embd_altup, n_layer, n_tokens], scaled by
    sqrt(n_embd_altup); a second token input, as llama.cpp's."""
    m, hp = g.model, g.hparams
    if g.params.embd_input:
        raise ValueError("gemma3n: an embeddings input (images, audio) has no token ids for the per-layer "
                         "embeddings; only token input is supported")
    inp = InpEmbd(g.params, hp.n_embd)
    g.inputs.append(inp)
    assert inp.tokens is not None       # a token input (embd_input is refused above)
    cur = ops.get_rows(g.need(m.per_layer_tok_embd, "per_layer_token_embd"), inp.tokens)
    cur = ops.reshape_3d(cur, hp.n_embd_altup, hp.n_layer, g.n_tokens)
    return g.cb(ops.scale(cur, math.sqrt(hp.n_embd_altup)), "inp_per_layer_selected")


def project_per_layer_inputs(g: GraphBuilder, inp_batch: Tensor, inp_per_layer: Tensor) -> Tensor:
    """The per-layer inputs: the projected input embedding, normed, plus the lookup, both
    scaled by 1/sqrt(2) -> [n_embd_altup, n_tokens, n_layer]."""
    m, hp = g.model, g.hparams
    proj = ops.mul_mat(g.need(m.per_layer_model_proj, "per_layer_model_proj"), inp_batch)
    proj = ops.reshape_3d(ops.scale(proj, 1.0 / math.sqrt(hp.n_embd)), hp.n_embd_altup, hp.n_layer, g.n_tokens)
    proj = g.cb(g.build_norm(proj, m.per_layer_proj_norm, None, LLMNormType.RMS, -1), "per_layer_proj")
    cur = g.cb(ops.scale(ops.add(proj, inp_per_layer), 1.0 / math.sqrt(2.0)), "inp_per_layer")
    return ops.cont(ops.permute(cur, 0, 2, 1, 3))


def laurel(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> Tensor:
    """cur plus its normed low-rank (laurel_l, laurel_r) image."""
    tmp = g.build_lora_mm(g.need(layer.laurel_l, "laurel_l", il), cur)
    tmp = g.build_lora_mm(g.need(layer.laurel_r, "laurel_r", il), tmp)
    tmp = g.build_norm(tmp, layer.laurel_post_norm, None, LLMNormType.RMS, il)
    return g.cb(ops.add(tmp, cur), "laurel_out", il)


def gaussian_topk(x: Tensor) -> Tensor:
    """Activation sparsity: x - (mean + 1.645 std) per row, negatives zeroed."""
    n = x.ne[0]
    mean = ops.scale(ops.sum_rows(x), 1.0 / n)
    std = ops.sqrt(ops.scale(ops.sum_rows(ops.sqr(ops.sub(x, mean))), 1.0 / (n - 1)))
    cutoff = ops.add(mean, ops.scale(std, SPARSITY_STD_MUL))
    return ops.clamp(ops.sub(x, cutoff), 0.0, math.inf)


def router_modalities(g: GraphBuilder, layer: Layer, x: Tensor, il: int) -> Tensor:
    """AltUp's router: tanh(altup_router (norm(x) / n_embd)) -> [n_altup, n_tokens]."""
    cur = g.build_norm(x, layer.altup_router_norm, None, LLMNormType.RMS, il)
    cur = ops.scale(cur, 1.0 / g.hparams.n_embd)
    return ops.tanh(ops.mul_mat(g.need(layer.altup_router, "altup_router", il), cur))


def altup_predict(g: GraphBuilder, layer: Layer, cur: Tensor, il: int) -> Tensor:
    """Every stream predicted as a per-token mix of all streams, added to itself."""
    n_altup = g.hparams.n_altup
    modalities = g.cb(router_modalities(g, layer, stream(cur, g.hparams.i_altup_act), il), "modalities", il)
    coefs = g.cb(g.build_lora_mm(g.need(layer.altup_predict_coef, "altup_predict_coef", il), modalities),
                 "all_coefs", il)
    coefs = ops.reshape_3d(coefs, n_altup, n_altup, g.n_tokens)
    by_token = ops.cont(ops.permute(cur, 1, 2, 0, 3))                 # [n_altup, n_embd, n_tokens]
    predictions = ops.cont(ops.permute(ops.mul_mat(by_token, coefs), 0, 2, 1, 3))
    return g.cb(ops.add(predictions, cur), "predictions", il)


def altup_correct(g: GraphBuilder, layer: Layer, predictions: Tensor, activated: Tensor, il: int) -> Tensor:
    """The predictions corrected by the innovation (the computed stream minus its
    prediction), weighted per stream by 1 + the router's coefficients."""
    n_altup = g.hparams.n_altup
    modalities = g.cb(router_modalities(g, layer, activated, il), "modalities", il)
    innovation = g.cb(ops.sub(activated, stream(predictions, g.hparams.i_altup_act)), "innovation", il)
    coefs = g.build_lora_mm(g.need(layer.altup_correct_coef, "altup_correct_coef", il), modalities)
    coefs = g.cb(ops.scale(coefs, 1.0, 1.0), "all_coefs", il)
    coefs = ops.reshape_3d(ops.cont(ops.transpose(coefs)), 1, g.n_tokens, n_altup)
    corrected = ops.mul(repeat_streams(innovation, n_altup), coefs)
    return g.cb(ops.add(corrected, predictions), "corrected", il)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    n_altup, i_act = hp.n_altup, hp.i_altup_act

    inpL = g.build_inp_embd(m.tok_embd)
    inpL = g.cb(ops.scale(inpL, 1.0 if g.params.embd_input else math.sqrt(hp.n_embd)), "inp_scaled")
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_per_layer = project_per_layer_inputs(g, inpL, build_inp_per_layer(g))

    # the other streams start as projections of the embedding, at its magnitude
    added = ops.mul_mat(g.need(m.altup_proj, "altup_proj"), repeat_streams(inpL, n_altup - 1))
    added = ops.div(ops.mul(added, magnitude(inpL)), magnitude(added))
    inpL = g.cb(ops.concat(inpL, added, 2), "inp_stacked")

    for il in range(hp.n_layer):
        layer = m.layers[il]
        predictions = altup_predict(g, layer, inpL, il)
        active = g.cb(stream(predictions, i_act), "active_prediction", il)
        cur = g.cb(g.build_norm(active, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        laurel_out = laurel(g, layer, cur, il)

        if hp.has_kv(il):
            q, k, v = g.build_qkv(layer, cur, il)
            q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
            k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
            v = g.cb(ops.rms_norm(v, hp.f_norm_rms_eps), "Vcur_normed", il)
            q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur_pos", il)
            k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur_pos", il)
            cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, hp.f_attention_scale, il)
        else:   # attends to the cache of hp.kv_layer(il): only the queries are computed
            q = g.cb(g.build_lora_mm(g.need(layer.wq, "attn_q", il), cur), "Qcur", il)
            q = ops.reshape_3d(q, hp.n_embd_head_k, hp.n_head(il), g.n_tokens)
            q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
            q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur_pos", il)
            cur = g.build_attn(inp_attn, layer.wo, None, q, None, None, hp.f_attention_scale, il)
        cur = g.cb(g.build_norm(cur, layer.attn_post_norm, None, LLMNormType.RMS, il), "attn_post_norm", il)
        cur = g.cb(ops.add(cur, active), "attn_gated", il)
        attn_laurel = g.cb(ops.scale(ops.add(cur, laurel_out), 1.0 / math.sqrt(2.0)), "attn_laurel", il)

        cur = g.cb(g.build_norm(attn_laurel, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        up = g.build_lora_mm(g.need(layer.ffn_up, "ffn_up", il), cur)
        gate = g.build_lora_mm(g.need(layer.ffn_gate, "ffn_gate", il), cur)
        if il < N_LAYER_SPARSITY:
            gate = gaussian_topk(gate)
        cur = ops.mul(up, ops.gelu(gate))
        cur = g.cb(g.build_lora_mm(g.need(layer.ffn_down, "ffn_down", il), cur), "ffn_out", il)
        # llama.cpp norms this with il = -1, so its inner node is named "norm" (kept for the diff)
        cur = g.cb(g.build_norm(cur, layer.ffn_post_norm, None, LLMNormType.RMS, -1), "ffn_post_norm", il)
        gated = g.cb(ops.add(cur, attn_laurel), "attn_ffw_laurel_gated", il)
        corrected = altup_correct(g, layer, predictions, gated, il)

        # the layer's per-layer input, gated by the corrected active stream, joins the others
        first = ops.mul(stream(corrected, i_act), g.need(layer.altup_correct_scale, "altup_correct_scale", il))
        first = g.build_lora_mm(g.need(layer.per_layer_inp_gate, "inp_gate", il), first)
        first = g.cb(ops.gelu(first), "first_prediction_gated", il)
        first = g.cb(ops.mul(first, stream(inp_per_layer, il)), "first_prediction_scaled", il)
        first = g.build_lora_mm(g.need(layer.per_layer_proj, "proj", il), first)
        first = g.cb(g.build_norm(first, layer.per_layer_post_norm, None, LLMNormType.RMS, il),
                     "first_prediction_out", il)
        rest = ops.add(streams_from(corrected, 1), first)
        inpL = g.cb(ops.concat(stream(corrected, 0), rest, 2), "l_out", il)

    # the streams merged back: the others projected out, at the active one's magnitude, averaged
    unembd = ops.mul_mat(g.need(m.altup_unembd_proj, "altup_unembd_proj"), streams_from(inpL, 1))
    unembd = ops.div(ops.mul(unembd, magnitude(stream(inpL, i_act))), magnitude(unembd))
    unembd = g.cb(unembd, "altup_unembd", -1)
    cur = stream(inpL, 0)
    for i in range(n_altup - 1):
        cur = ops.add(cur, stream(unembd, i))
    cur = g.cb(ops.scale(cur, 1.0 / n_altup), "unembd_merged")
    inp_out_ids = g.build_inp_out_ids()
    if inp_out_ids is not None:
        cur = ops.get_rows(cur, inp_out_ids)
    g.build_output(cur, final_softcap=hp.f_final_logit_softcapping)
