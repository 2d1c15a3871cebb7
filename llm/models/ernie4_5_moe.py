"""ERNIE 4.5 MoE (21B-A3B, 300B-A47B): llama.cpp's src/models/ernie4-5-moe.cpp, a variant of
ERNIE 4.5 (llm/models/ernie4_5.py: the same attention and tensors). After
`leading_dense_block_count` dense layers, every `interleave_moe_layer_step`-th layer is a softmax
mixture of experts (renormalized weights, an optional selection bias) plus a shared expert."""
from __future__ import annotations

from ggmlx import ops
from llm.arch import LLMKV
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType, HParams
from llm.loader import GGUFMeta
from llm.models import ernie4_5
from llm.models.ernie4_5 import build_attn_block, load_tensors

__all__ = ["build_graph", "load_hparams", "load_tensors"]


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    ernie4_5.load_hparams(hp, ml)
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    hp.n_moe_layer_step = ml.get_key(LLMKV.INTERLEAVE_MOE_LAYER_STEP, int)
    hp.n_layer_dense_lead = ml.get_key(LLMKV.LEADING_DENSE_BLOCK_COUNT, int, 0)
    if hp.n_moe_layer_step <= 0:
        raise ml.error(f"'{ml.key_name(LLMKV.INTERLEAVE_MOE_LAYER_STEP)}' must be > 0, got {hp.n_moe_layer_step}")
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be "
                       "> 0 for ernie4_5-moe")


def is_moe_layer(hp: HParams, il: int) -> bool:
    return il >= hp.n_layer_dense_lead and (il + 1) % hp.n_moe_layer_step == 0


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    for il in range(hp.n_layer):
        layer = m.layers[il]
        ffn_inp = build_attn_block(g, layer, inpL, inp_pos, inp_attn, inp_out_ids, il)
        cur = g.cb(g.build_norm(ffn_inp, layer.ffn_norm, None, LLMNormType.RMS, il), "ffn_norm", il)
        if not is_moe_layer(hp, il):
            cur = g.cb(g.build_ffn(cur, layer.ffn_up, layer.ffn_gate, layer.ffn_down, LLMFfnOpType.SILU,
                                   LLMFfnGateType.PAR, il), "ffn_out", il)
        else:
            moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps,
                                      layer.ffn_down_exps, hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True,
                                      ExpertGatingFuncType.SOFTMAX, il, exp_probs_b=layer.ffn_exp_probs_b,
                                      w_scale=hp.expert_weights_scale)
            if hp.n_ff_shexp > 0:
                shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                                         LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
                moe_out = ops.add(moe_out, shexp)
            cur = g.cb(moe_out, "ffn_out", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    g.build_output(inpL)
