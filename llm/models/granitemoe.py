"""Granite MoE (3.0 / 3.1 MoE, optionally with a shared expert): llama.cpp's
src/models/granite-moe.cpp, whose graph is Granite's (llm/models/granite.py). Its hparams
differ only in that rope is always on and `expert_shared_feed_forward_length` may be set."""
from __future__ import annotations

from llm.arch import LLMKV
from llm.hparams import HParams, RopeType
from llm.loader import GGUFMeta
from llm.models.granite import build_graph, load_tensors

__all__ = ["build_graph", "load_hparams", "load_tensors"]


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.f_norm_rms_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_RMS_EPS, float)
    hp.f_logit_scale = ml.get_key(LLMKV.LOGIT_SCALE, float)
    if hp.f_logit_scale == 0.0:
        raise ml.error(f"'{ml.key_name(LLMKV.LOGIT_SCALE)}' must not be 0 (logits are divided by it)")
    hp.f_residual_scale = ml.get_key(LLMKV.RESIDUAL_SCALE, float, 0.0)
    hp.f_embedding_scale = ml.get_key(LLMKV.EMBEDDING_SCALE, float, 0.0)
    hp.f_attention_scale = ml.get_key(LLMKV.ATTENTION_SCALE, float, 0.0)
    hp.n_ff_shexp = ml.get_key(LLMKV.EXPERT_SHARED_FEED_FORWARD_LENGTH, int, 0)
    if hp.n_expert == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' must be > 0 for granitemoe")
