"""Qwen3.5 / Qwen3.6 MoE (35B-A3B, 122B-A10B, ...): llama.cpp's src/models/qwen35moe.cpp.

Qwen3.5's trunk (qwen35.py: Gated DeltaNet layers and gated full attention) with a
softmax-routed MoE FFN in every layer plus a shared expert whose output is scaled by
sigmoid(ffn_gate_inp_shexp . x)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ggmlx import ops
from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder, LLMFfnGateType, LLMFfnOpType
from llm.hparams import ExpertGatingFuncType, HParams
from llm.layer import Layer, create_embd_output
from llm.loader import GGUFMeta, ModelLoader, TensorFlag
from llm.models import qwen35

if TYPE_CHECKING:
    import jax

    from ggmlx.tensor import Tensor
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    qwen35.load_hparams(hp, ml)
    load_moe_hparams(hp, ml)


def load_moe_hparams(hp: HParams, ml: GGUFMeta) -> None:
    """The expert and shared-expert widths (optional: n_ff / n_expert_used and n_ff)."""
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer + hp.n_layer_nextn, [0])[0]
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    hp.expert_weights_scale = ml.get_key(LLMKV.EXPERT_WEIGHTS_SCALE, float, 0.0)
    if hp.n_expert == 0 or hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' and '{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' must be "
                       f"> 0 for {hp.arch.value}")


def create_moe(layer: Layer, ml: ModelLoader, hp: HParams, il: int, dev: jax.Device) -> None:
    """The router, the experts (gate and up fused or apart) and the gated shared expert."""
    n_embd, n_exp = hp.n_embd, hp.n_expert
    n_ff_exp = hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used
    n_sh = hp.n_ff_shexp or hp.n_ff(il)
    layer.ffn_gate_inp = ml.create_tensor(tn(T.FFN_GATE_INP, "weight", il), (n_embd, n_exp), dev)
    layer.ffn_down_exps = ml.create_tensor(tn(T.FFN_DOWN_EXPS, "weight", il), (n_ff_exp, n_embd, n_exp), dev)
    # gate and up fused along their rows (convert_hf_to_gguf --fuse-gate-up-exps), or apart
    layer.ffn_gate_up_exps = ml.create_tensor(tn(T.FFN_GATE_UP_EXPS, "weight", il), (n_embd, 2 * n_ff_exp, n_exp),
                                              dev, TensorFlag.NOT_REQUIRED)
    if layer.ffn_gate_up_exps is None:
        layer.ffn_gate_exps = ml.create_tensor(tn(T.FFN_GATE_EXPS, "weight", il), (n_embd, n_ff_exp, n_exp), dev)
        layer.ffn_up_exps = ml.create_tensor(tn(T.FFN_UP_EXPS, "weight", il), (n_embd, n_ff_exp, n_exp), dev)
    layer.ffn_gate_inp_shexp = ml.create_tensor(tn(T.FFN_GATE_INP_SHEXP, "weight", il), (n_embd,), dev)
    layer.ffn_gate_shexp = ml.create_tensor(tn(T.FFN_GATE_SHEXP, "weight", il), (n_embd, n_sh), dev)
    layer.ffn_up_shexp = ml.create_tensor(tn(T.FFN_UP_SHEXP, "weight", il), (n_embd, n_sh), dev)
    layer.ffn_down_shexp = ml.create_tensor(tn(T.FFN_DOWN_SHEXP, "weight", il), (n_sh, n_embd), dev)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    create_embd_output(model, ml)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        qwen35.create_trunk_mixer(layer, ml, hp, il, dev)
        if hp.is_recurrent(il):
            qwen35.create_delta_net_projections(layer, ml, hp, il, dev)
        create_moe(layer, ml, hp, il, dev)
        model.layers.append(layer)
    qwen35.skip_mtp_layers(hp, ml)


def build_moe_ffn(g: GraphBuilder, cur: Tensor, layer: Layer, il: int) -> Tensor:
    """Routed experts (softmax, top-k weights renormalized) plus the sigmoid-gated shared one."""
    hp = g.hparams
    moe_out = g.build_moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                              hp.n_expert, hp.n_expert_used, LLMFfnOpType.SILU, True, ExpertGatingFuncType.SOFTMAX,
                              il, w_scale=hp.expert_weights_scale, gate_up_exps=layer.ffn_gate_up_exps)
    g.cb(moe_out, "ffn_moe_out", il)
    shexp = g.cb(g.build_ffn(cur, layer.ffn_up_shexp, layer.ffn_gate_shexp, layer.ffn_down_shexp,
                             LLMFfnOpType.SILU, LLMFfnGateType.PAR, il), "ffn_shexp", il)
    gate = g.cb(g.build_lora_mm(g.need(layer.ffn_gate_inp_shexp, "ffn_gate_inp_shexp", il), cur),
                "shared_expert_gate", il)
    gate = g.cb(ops.sigmoid(gate), "shared_expert_gate_sigmoid", il)
    shexp = g.cb(ops.mul(shexp, gate), "ffn_shexp_gated", il)
    return g.cb(ops.add(moe_out, shexp), "ffn_out", il)


def build_graph(g: GraphBuilder) -> None:
    qwen35.build_trunk(g, build_moe_ffn)
