"""Command-R (Cohere's c4ai-command-r): llama.cpp's src/models/command-r.cpp.

A parallel block: attention and the SiLU-gated FFN both read the same LayerNorm'd input (no
bias), and the layer output is residual + attention + FFN. Q/K/V are separate or fused, with
optional biases (create_tensor_qkv). The output head is always the
token embedding (tied), its logits multiplied by `logit_scale`. Models of 64 layers and more
LayerNorm each query and key head (weights [head_dim, n_head]) before rope."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import HParams, RopeType
from llm.layer import Layer, create_qkv
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model

QK_NORM_LAYERS = 64        # llama.cpp: the q/k norms exist from this many layers on (Command-R+)


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_logit_scale = ml.get_key(LLMKV.LOGIT_SCALE, float, 0.0)      # 0: logits as they are
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    """token_embd (also the output head, duplicated on the output device), output_norm, and per
    layer attn_norm, q/k/v/o, the FFN, and the q/k norms of 64-layer models."""
    hp = model.hparams
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (hp.n_embd, hp.n_vocab), model.place.dev_input)
    model.output_norm = ml.create_tensor(tn(T.OUTPUT_NORM, "weight"), (hp.n_embd,), model.place.dev_output)
    model.output = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (hp.n_embd, hp.n_vocab), model.place.dev_output,
                                    TensorFlag.DUPLICATED)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        if hp.n_layer >= QK_NORM_LAYERS:
            layer.attn_q_norm = ml.create_tensor(tn(T.ATTN_Q_NORM, "weight", il), (hp.n_embd_head_k, hp.n_head(il)),
                                                 dev)
            layer.attn_k_norm = ml.create_tensor(tn(T.ATTN_K_NORM, "weight", il),
                                                 (hp.n_embd_head_k, hp.n_head_kv(il)), dev)
        create_qkv(layer, ml, il, dev, hp.n_embd, hp.n_embd, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (hp.n_embd, hp.n_embd), dev)
        n_ff = hp.n_ff(il)      # no ffn_norm: the FFN reads attn_norm's output
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (hp.n_embd, n_ff), dev)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, hp.n_embd), dev)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (hp.n_embd, n_ff), dev)
        model.layers.append(layer)


def build_block(g: GraphBuilder, layer: Layer, inpL, inp_pos, inp_attn, inp_out_ids, il: int, *, rope: bool):
    """One parallel layer: l_out = inpL + attn(norm(inpL)) + ffn(norm(inpL)); `rope` off for
    cohere2's global layers (no positional encoding there)."""
    hp = g.hparams
    cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.NORM, il), "attn_norm", il)
    ffn_inp = cur
    q, k, v = g.build_qkv(layer, cur, il)
    if layer.attn_q_norm is not None:
        q = g.cb(g.build_norm(q, layer.attn_q_norm, None, LLMNormType.NORM, il), "Qcur", il)
    if rope:
        q = ops.rope_ext(q, inp_pos, None, **g.rope_params(il))
    if layer.attn_k_norm is not None:
        k = g.cb(g.build_norm(k, layer.attn_k_norm, None, LLMNormType.NORM, il), "Kcur", il)
    if rope:
        k = ops.rope_ext(k, inp_pos, None, **g.rope_params(il))
    q, k = g.cb(q, "Qcur", il), g.cb(k, "Kcur", il)
    cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_k), il)
    if il == hp.n_layer - 1 and inp_out_ids is not None:
        cur = ops.get_rows(cur, inp_out_ids)
        inpL = ops.get_rows(inpL, inp_out_ids)
        ffn_inp = ops.get_rows(ffn_inp, inp_out_ids)
    attn_out = cur
    cur = g.cb(g.build_ffn(ffn_inp, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                           LLMFfnGateType.PAR, il), "ffn_out", il)
    cur = ops.add(ops.add(cur, inpL), attn_out)
    return g.cb(cur, "l_out", il)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    for il in range(hp.n_layer):
        inpL = build_block(g, m.layers[il], inpL, inp_pos, inp_attn, inp_out_ids, il, rope=True)
    g.build_output(inpL, type_norm=LLMNormType.NORM, logit_scale=hp.f_logit_scale or 1.0)
