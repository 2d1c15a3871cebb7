"""nomic-bert: the BERT encoder of llm/models/bert.py with rotary positions (NEOX) instead of
learned ones, a fused attn_qkv and a SiLU-gated FFN without biases (llama.cpp's
src/models/nomic-bert.cpp, graph shared with bert.cpp)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llm.arch import LLMKV, tn
from llm.arch import LLMTensor as T
from llm.graph import GraphBuilder
from llm.hparams import HParams, RopeType
from llm.layer import Layer
from llm.loader import GGUFMeta, ModelLoader
from llm.models.bert import OPT, build_encoder, load_block, load_input_and_head

if TYPE_CHECKING:
    from llm.model import Model


def load_hparams(hp: HParams, ml: GGUFMeta) -> None:
    hp.rope_type = RopeType.NEOX
    hp.f_norm_eps = ml.get_key(LLMKV.ATTENTION_LAYERNORM_EPS, float)


def load_tensors(model: Model, ml: ModelLoader) -> None:
    hp = model.hparams
    load_input_and_head(model, ml, positions=False)
    for il in range(hp.n_layer):
        dev = model.place.dev_layer[il]
        layer = Layer()
        load_block(layer, ml, hp, il, dev)
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
        layer.ffn_up = ml.create_tensor(tn(T.FFN_UP, "weight", il), (n_embd, n_ff), dev)
        layer.ffn_up_b = ml.create_tensor(tn(T.FFN_UP, "bias", il), (n_ff,), dev, OPT)
        layer.ffn_down = ml.create_tensor(tn(T.FFN_DOWN, "weight", il), (n_ff, n_embd), dev)
        layer.ffn_down_b = ml.create_tensor(tn(T.FFN_DOWN, "bias", il), (n_embd,), dev, OPT)
        layer.ffn_gate = ml.create_tensor(tn(T.FFN_GATE, "weight", il), (n_embd, n_ff), dev)
        model.layers.append(layer)


def build_graph(g: GraphBuilder) -> None:
    build_encoder(g, rope=True)
