"""Mamba-2: llama.cpp's src/models/mamba2.cpp (its load_arch_*; the graph is mamba.cpp's with
mamba-base.cpp's build_mamba2_layer).

Like Mamba, every layer is an SSM block with a residual, but the scan has one scalar decay
per head, B and C are shared by groups of heads, and the gated output is RMS-normed per
group. The recurrent memory holds each sequence's conv state over x, B, C and its SSM state."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMNormType
from llm.hparams import HParams
from llm.layer import Layer, create_embd_output, create_mamba2
from llm.loader import GGUFMeta, ModelLoader

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.ssm_d_conv = ml.get_key(LLMKV.SSM_CONV_KERNEL, int)
    hp.ssm_d_inner = ml.get_key(LLMKV.SSM_INNER_SIZE, int)
    hp.ssm_d_state = ml.get_key(LLMKV.SSM_STATE_SIZE, int)
    hp.ssm_dt_rank = ml.get_key(LLMKV.SSM_TIME_STEP_RANK, int)
    hp.ssm_n_group = ml.get_key(LLMKV.SSM_GROUP_COUNT, int)
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    check_mamba2(hp, ml)


def check_mamba2(hp: HParams, ml: GGUFMeta) -> None:
    """The SSM sizes a Mamba-2 block needs: positive, heads dividing the inner width, groups
    dividing the heads."""
    for key, value in ((LLMKV.SSM_CONV_KERNEL, hp.ssm_d_conv), (LLMKV.SSM_INNER_SIZE, hp.ssm_d_inner),
                       (LLMKV.SSM_STATE_SIZE, hp.ssm_d_state), (LLMKV.SSM_TIME_STEP_RANK, hp.ssm_dt_rank),
                       (LLMKV.SSM_GROUP_COUNT, hp.ssm_n_group)):
        if value < 1:
            raise ml.error(f"'{ml.key_name(key)}' = {value} must be positive")
    if hp.ssm_d_inner % hp.ssm_dt_rank or hp.ssm_dt_rank % hp.ssm_n_group:
        raise ml.error(f"'{ml.key_name(LLMKV.SSM_TIME_STEP_RANK)}' = {hp.ssm_dt_rank} heads must divide "
                       f"'{ml.key_name(LLMKV.SSM_INNER_SIZE)}' = {hp.ssm_d_inner} and be a multiple of "
                       f"'{ml.key_name(LLMKV.SSM_GROUP_COUNT)}' = {hp.ssm_n_group}")


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        layer.attn_norm = ml.create_tensor(tn(T.ATTN_NORM, "weight", il), (hp.n_embd,), dev)
        create_mamba2(layer, ml, hp, il, dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    rs_inp = g.build_rs_inp()
    inp_out_ids = g.build_inp_out_ids()

    for il in range(hp.n_layer):
        layer = m.layers[il]
        cur = g.cb(g.build_norm(inpL, layer.attn_norm, None, LLMNormType.RMS, il), "attn_norm", il)
        cur = g.build_mamba2_layer(rs_inp, cur, layer, il)
        if il == hp.n_layer - 1 and inp_out_ids is not None:
            cur = ops.get_rows(cur, inp_out_ids)
            inpL = ops.get_rows(inpL, inp_out_ids)
        inpL = g.cb(ops.add(cur, inpL), "l_out", il)

    g.build_output(inpL)
