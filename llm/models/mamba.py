"""Mamba: llama.cpp's src/models/mamba.cpp (its load_arch_* and graph, with the block of
mamba-base.cpp's build_mamba_layer).

Every layer is a Mamba block over an RMS norm with a residual: no attention, no FFN and no
positions. The context holds a recurrent memory (llm.memory_recurrent): each sequence's conv
and SSM states, so a decode step costs the same at any position."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMNormType
from llm.hparams import HParams
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_dt_b_c_rms = ml.get_key(LLMKV.SSM_DT_B_C_RMS, bool, False)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    for key, value in ((LLMKV.SSM_CONV_KERNEL, hp.ssm_d_conv), (LLMKV.SSM_INNER_SIZE, hp.ssm_d_inner),
                       (LLMKV.SSM_STATE_SIZE, hp.ssm_d_state), (LLMKV.SSM_TIME_STEP_RANK, hp.ssm_dt_rank)):
        if value < 1:
            raise ml.error(f"'{ml.key_name(key)}' = {value} must be positive")
    if hp.ssm_d_inner != 2 * hp.n_embd:     # as llama.cpp, which supports only this expansion
        raise ml.error(f"'{ml.key_name(LLMKV.SSM_INNER_SIZE)}' = {hp.ssm_d_inner}: only an expansion factor "
                       f"of 2 (2 * n_embd = {2 * hp.n_embd}) is supported")
    hp.ssm_n_group = 0                      # Mamba-1's conv state is x alone


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    d_conv, d_inner, d_state, dt_rank = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
    create_embd_output(model, ml)
    opt = TensorFlag.NOT_REQUIRED
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        layer.ssm_in = ml.create_tensor(tn(T.SSM_IN, "weight", il), (hp.n_embd, 2 * d_inner), dev)
        layer.ssm_conv1d = ml.create_tensor(tn(T.SSM_CONV1D, "weight", il), (d_conv, d_inner), dev)
        layer.ssm_conv1d_b = ml.create_tensor(tn(T.SSM_CONV1D, "bias", il), (d_inner,), dev)
        layer.ssm_x = ml.create_tensor(tn(T.SSM_X, "weight", il), (d_inner, dt_rank + 2 * d_state), dev)
        layer.ssm_dt = ml.create_tensor(tn(T.SSM_DT, "weight", il), (dt_rank, d_inner), dev)
        layer.ssm_dt_b = ml.create_tensor(tn(T.SSM_DT, "bias", il), (d_inner,), dev)
        layer.ssm_a = ml.create_tensor(tn(T.SSM_A, None, il), (d_state, d_inner), dev)   # no "weight" suffix
        layer.ssm_d = ml.create_tensor(tn(T.SSM_D, None, il), (d_inner,), dev)
        layer.ssm_out = ml.create_tensor(tn(T.SSM_OUT, "weight", il), (d_inner, hp.n_embd), dev)
        # falcon-mamba's norms of dt, B and C (optional, as in llama.cpp's jamba/falcon files)
        layer.ssm_dt_norm = ml.create_tensor(tn(T.SSM_DT_NORM, "weight", il), (dt_rank,), dev, opt)
        layer.ssm_b_norm = ml.create_tensor(tn(T.SSM_B_NORM, "weight", il), (d_state,), dev, opt)
        layer.ssm_c_norm = ml.create_tensor(tn(T.SSM_C_NORM, "weight", il), (d_state,), dev, opt)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    rs_inp = g.build_rs_inp()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        cur = g.build_mamba_layer(rs_inp, cur, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
        inpL = g.cb(ops.add(cur, inpL), "l_out", il)

    g.build_output(inpL)
