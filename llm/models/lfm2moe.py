"""LFM2-MoE: llama.cpp's src/models/lfm2moe.cpp (its load_arch_*; the graph is lfm2.cpp's).

LFM2's short-conv and attention layers; the first `leading_dense_block_count` layers have
the dense FFN, the rest a routed mixture of experts with a selection bias (`exp_probs_b`),
the file's gating function (sigmoid in the released models) and renormalized weights."""
from __future__ import annotations

from llm.arch import LLMKV
from llm.hparams import ExpertGatingFuncType, HParams
from llm.loader import GGUFMeta
from llm.models.lfm2 import build_graph, check_ffn, load_shortconv_hparams, load_tensors

__all__ = ["build_graph", "load_hparams", "load_tensors"]


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    load_shortconv_hparams(hp, ml)
    hp.n_layer_dense_lead = ml.get_key(LLMKV.LEADING_DENSE_BLOCK_COUNT, int, 0)
    hp.n_ff_exp = ml.get_key_or_arr(LLMKV.EXPERT_FEED_FORWARD_LENGTH, int, hp.n_layer)[0]
    hp.expert_gating_func = ml.get_key(LLMKV.EXPERT_GATING_FUNC, int)
    if not 0 <= hp.n_layer_dense_lead <= hp.n_layer:
        raise ml.error(f"'{ml.key_name(LLMKV.LEADING_DENSE_BLOCK_COUNT)}' = {hp.n_layer_dense_lead} must be in "
                       f"[0, {hp.n_layer}]")
    if hp.n_layer_dense_lead < hp.n_layer:      # llama.cpp asserts experts on the MoE layers
        if not 0 < hp.n_expert_used <= hp.n_expert:
            raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' = {hp.n_expert_used} must be in "
                           f"[1, '{ml.key_name(LLMKV.EXPERT_COUNT)}' = {hp.n_expert}]")
        if hp.n_ff_exp <= 0:
            raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_FEED_FORWARD_LENGTH)}' = {hp.n_ff_exp} must be positive")
        if hp.expert_gating_func not in (ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SIGMOID):
            raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_GATING_FUNC)}' = {hp.expert_gating_func}: only softmax (1) "
                           f"and sigmoid (2) gating are supported")
    check_ffn(hp, ml)
