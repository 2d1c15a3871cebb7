"""Cohere2 (Command R7B, Command A): llama.cpp's src/models/cohere2-iswa.cpp, a variant of
Command-R (llm/models/command_r.py: the same parallel block and tied, scaled output). Three
sliding-window layers with rope, then one global layer without any positional encoding."""
from __future__ import annotations

from llm.arch import LLMKV
from llm.graph import GraphBuilder, LLMNormType
from llm.hparams import HParams, RopeType, SWAType, load_swa_pattern
from llm.loader import GGUFMeta
from llm.models.command_r import build_block, load_tensors

__all__ = ["build_graph", "load_hparams", "load_tensors"]

SWA_PATTERN = 4         # llama.cpp's default: layers 0-2 of every 4 slide, layer 3 is global


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NORM
    hp.swa_type = SWAType.STANDARD
    load_swa_pattern(hp, ml, SWA_PATTERN)
    hp.rope_freq_base_train_swa = ml.get_key(LLMKV.ROPE_FREQ_BASE_SWA, float, hp.rope_freq_base_train)
    hp.rope_freq_scale_train_swa = hp.rope_freq_scale_train
    hp.n_swa = ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW, int)
    hp.f_logit_scale = ml.get_key(LLMKV.LOGIT_SCALE, float)
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def build_graph(g: GraphBuilder) -> None:
    m, hp = g.model, g.hparams
    inpL = g.build_inp_embd(m.tok_embd)
    inp_pos = g.build_inp_pos()
    inp_attn = g.build_attn_inp_kv()
    inp_out_ids = g.build_inp_out_ids()
    for il in range(hp.n_layer):
        inpL = build_block(g, m.layers[il], inpL, inp_pos, inp_attn, inp_out_ids, il, rope=hp.is_swa(il))
    g.build_output(inpL, type_norm=LLMNormType.NORM, logit_scale=hp.f_logit_scale or 1.0)
