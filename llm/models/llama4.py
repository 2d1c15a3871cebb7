"""Llama 4 (text): llama.cpp's src/models/llama4.cpp.

Llama blocks (RMS pre-norms, NORM rope, GQA) where every 4th layer uses no rope (NoPE) and
scales its queries by the attention temperature log(floor((pos + 1) / 8192) + 1) * 0.1 + 1;
rope layers RMS-normalize Q and K (without weights) after rope, except in the 128-expert
model; the other layers attend in chunks of 8192 tokens (3 chunked, 1 full). Every
`interleave_moe_layer_step`-th layer is a mixture of experts with a sigmoid router whose
weights scale each expert's input, plus a shared expert; the others have a dense FFN."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams, RopeType, SWAType, load_swa_pattern
from llm.layer import Layer, create_attn, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model

NO_ROPE_LAYER_STEP = 4
CHUNK = 8192


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.n_moe_layer_step = ml.get_key(LLMKV.INTERLEAVE_MOE_LAYER_STEP, int)
    if hp.n_expert == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' must be > 0 for llama4")
    no_rope_step = NO_ROPE_LAYER_STEP
    if ml.has_key(LLMKV.ATTENTION_SLIDING_WINDOW) and ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int) == 0:
        hp.swa_type = SWAType.NONE
        no_rope_step = hp.n_layer      # as llama.cpp: "always rope", which leaves the last layer NoPE
    else:
        hp.swa_type = SWAType.CHUNKED
        hp.n_swa = CHUNK
        hp.n_attn_temp_floor_scale = CHUNK
        hp.f_attn_temp_scale = 0.1
        hp.f_attn_temp_offset = 1.0
        load_swa_pattern(hp, ml, 4)
        hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
        hp.rope_freq_scale_train_swa = hp.rope_freq_scale_train
    hp.rope_layers = [(il + 1) % no_rope_step != 0 for il in range(hp.n_layer)]
    hp.use_kq_norm = hp.n_expert != 128


def is_moe_layer(hp: HParams, il: int) -> bool:
    return hp.n_moe_layer_step > 0 and (il + 1) % hp.n_moe_layer_step == 0


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    n_embd = hp.n_embd
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        create_attn(layer, ml, hp, il, dev)
        layer.ffn_norm = ml.create_tensor(tn(T.FFN_NORM, "weight", il), (n_embd,), dev)
        flags = TensorFlag.NOT_REQUIRED | (TensorFlag.DUPLICATED if il else TensorFlag.NONE)
        layer.rope_freqs = ml.create_tensor(tn(T.ROPE_FREQS, "weight"), (hp.n_rot // 2,), dev, flags)
        if is_moe_layer(hp, il):
            n_ff, n_exp = hp.n_ff_exp, hp.n_expert
            layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
            layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff, n_embd, n_exp), dev)
            layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff, n_exp), dev)
            layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_ff), dev)
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
            layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
            layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    kq_scale = hp.f_attention_scale if hp.f_attention_scale else 1.0 / math.sqrt(hp.n_embd_head_v)

    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn_scale = g.build_inp_attn_scale() if hp.f_attn_temp_scale else None
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        inpSA = inpL
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        q, k, v = g.build_qkv(layer, cur, il)
        if hp.has_rope(il):
            q = g.cb(ops.rope_ext(q, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Qcur", il)
            k = g.cb(ops.rope_ext(k, inp_pos, layer.rope_freqs, **g.rope_params(il)), "Kcur", il)
            if hp.use_kq_norm:
                q = g.cb(ops.rms_norm(q, hp.f_norm_rms_eps), "Qcur_normed", il)
                k = g.cb(ops.rms_norm(k, hp.f_norm_rms_eps), "Kcur_normed", il)
        elif inp_attn_scale is not None:
            q = g.cb(ops.mul(q, inp_attn_scale), "Qcur_attn_temp_scaled", il)
        cur = g.build_attn(inp_attn, layer.wo, None, q, k, v, kq_scale, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpSA = ops.get_rows(inpSA, inp_out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)

        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        if layer.ffn_gate_inp is None:
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                                   LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_out", il)
        else:       # names as llama.cpp's MoE branch (which has no ffn_out)
            moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                      layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, False,
                                      ExpertGatingFuncType.SIGMOID, il, weight_before_ffn=True)
            shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                     LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_moe_shexp", il)
            cur = g.cb(ops.add(moe_out, shexp), "ffn_moe_out_merged", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)

    g.build_output(inpL)
