"""BERT encoders (bert; nomic-bert in llm/models/nomic_bert.py reuses this graph): llama.cpp's
src/models/bert.cpp.

Token + token-type (row 0, "sentence A") + learned position embeddings, LayerNorm; then
post-norm blocks: non-causal attention with biases, add, LayerNorm, a sequential GELU FFN,
add, LayerNorm. No output projection: the last hidden state (`result_embd`) is pooled into
embeddings, or through the classifier head (cls, cls.output) for rank pooling."""
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

OPT = TensorFlag.NOT_REQUIRED


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def load_input_and_head(model: Model, ml: ModelLoader, *, positions: bool) -> None:
    """Token / type / position embeddings, the embedding norm and the optional classifier head."""
    hp = model.hparams
    if hp.n_token_types == 0:
        raise ml.error(f"{model.arch} model needs '{LLMKV.TOKENIZER_TOKEN_TYPE_COUNT.value}' (token type count)")
    dev, dev_out = model.place.dev_input, model.place.dev_output
    n_embd = hp.n_embd
    model.tok_embd = ml.create_tensor(tn(T.TOKEN_EMBD, "weight"), (n_embd, hp.n_vocab), dev)
    model.type_embd = ml.create_tensor(tn(T.TOKEN_TYPES, "weight"), (n_embd, hp.n_token_types), dev, OPT)
    if positions:
        model.pos_embd = ml.create_tensor(tn(T.POS_EMBD, "weight"), (n_embd, hp.n_ctx_train), dev)
    model.cls = ml.create_tensor(tn(T.CLS, "weight"), (n_embd, n_embd), dev_out, OPT)
    model.cls_b = ml.create_tensor(tn(T.CLS, "bias"), (n_embd,), dev_out, OPT)
    model.cls_out = ml.create_tensor(tn(T.CLS_OUT, "weight"), (n_embd, hp.n_cls_out), dev_out, OPT)
    model.cls_out_b = ml.create_tensor(tn(T.CLS_OUT, "bias"), (hp.n_cls_out,), dev_out, OPT)
    model.tok_norm = ml.create_tensor(tn(T.TOKEN_EMBD_NORM, "weight"), (n_embd,), dev)
    model.tok_norm_b = ml.create_tensor(tn(T.TOKEN_EMBD_NORM, "bias"), (n_embd,), dev)


def load_block(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev) -> None:
    """The attention and norm tensors of one block (the FFN is the caller's)."""
    n_embd, n_embd_gqa = hp.n_embd, hp.n_embd_k_gqa(il)
    create_qkv(layer, ml, il, dev, n_embd, n_embd, n_embd_gqa, n_embd_gqa)
    layer.wo = ml.create_tensor(tn(T.ATTN_OUT, "weight", il), (n_embd, n_embd), dev)
    layer.bo = ml.create_tensor(tn(T.ATTN_OUT, "bias", il), (n_embd,), dev, OPT)
    layer.attn_out_norm = ml.create_tensor(tn(T.ATTN_OUT_NORM, "weight", il), (n_embd,), dev)
    layer.attn_out_norm_b = ml.create_tensor(tn(T.ATTN_OUT_NORM, "bias", il), (n_embd,), dev)
    layer.layer_out_norm = ml.create_tensor(tn(T.LAYER_OUT_NORM, "weight", il), (n_embd,), dev)
    layer.layer_out_norm_b = ml.create_tensor(tn(T.LAYER_OUT_NORM, "bias", il), (n_embd,), dev)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    load_input_and_head(model, ml, positions=True)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        load_block(layer, ml, hp, il, dev)
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, OPT)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, OPT)
        model.layers.append(layer)


def build_encoder(g: GraphBuilder, *, rope: bool) -> None:
    """The BERT graph; `rope` (nomic-bert) rotates Q and K instead of adding learned
    positions, and its FFN is SiLU-gated (layer.ffn_gate set)."""
    m, hp = g.model, g.hparams
    d = hp.n_embd_head_v

    inp_pos = g.build_inp_pos()
    inpL = g.build_inp_embd(m.tok_embd)
    if m.type_embd is not None:
        # token types are always 0 ("sentence A"), as in llama.cpp
        inpL = ops.add(inpL, ops.view_1d(m.type_embd, hp.n_embd, 0))
    if m.pos_embd is not None:
        inpL = ops.add(ops.get_rows(m.pos_embd, inp_pos), inpL)
    g.cb(inpL, "inp_embd")
    inpL = g.cb(g.build_norm(inpL, m.tok_norm, m.tok_norm_b, LLMNormType.NORM, -1), "inp_norm")

    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        q, k, v = g.build_qkv(layer, inpL, il)
        if rope:
            q = g.cb(ops.rope_ext(q, inp_pos, None, **g.rope_params(il)), "Qcur", il)
            k = g.cb(ops.rope_ext(k, inp_pos, None, **g.rope_params(il)), "Kcur", il)
        cur = g.build_attn(inp_attn, layer.wo, layer.bo, q, k, v, 1.0 / math.sqrt(d), il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
        cur = ops.add(cur, inpL)
        cur = g.build_norm(cur, layer.attn_out_norm, layer.attn_out_norm_b, LLMNormType.NORM, il)
        cur = g.cb(cur, "attn_out_norm", il)
        ffn_inp = g.cb(cur, "ffn_inp", il)
        if layer.ffn_gate is not None:
            cur = g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down,
                              LLMFfnOpType.SILU, LLMFfnGateType.PAR, il)
        else:
            cur = g.build_ffn(cur, layer.ffn_up, None, layer.ffn_down, LLMFfnOpType.GELU, LLMFfnGateType.SEQ, il,
                              up_b=layer.ffn_up_b, down_b=layer.ffn_down_b)
        g.cb(cur, "ffn_out", il)
        cur = ops.add(cur, ffn_inp)
        cur = g.build_norm(cur, layer.layer_out_norm, layer.layer_out_norm_b, LLMNormType.NORM, il)
        inpL = g.cb(cur, "l_out", il)

    g.build_embd_output(inpL, "result_embd")


def build_graph(g: GraphBuilder) -> None:
    build_encoder(g, rope=False)
